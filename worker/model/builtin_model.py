"""Random-weight Llama-family models for tests and benchmarks, and the built-in small model.

`make_model_dir` writes a Hugging Face model directory (config.json + safetensors) with
transformers' own config classes and `save_pretrained`, initialised deterministically from a
seed, so transformers itself is the reference for whatever we load from it.

`builtin_model_path` is the small model that `pagefleet serve` runs with no download: a
4-layer Llama with a byte-level BPE tokenizer trained offline on the text below.

Why the built-in model is initialised the way it is: random-weight models have flat logits
and fall into repeating one token. Two knobs fix both:
- `initializer_range` 0.1 instead of transformers' 0.02. At 0.02 each layer's update is small
  next to a context-independent common component of the residual stream, so the argmax sits on
  a few "hub" tokens and greedy runs repeat them; at 0.1 attention and MLP mix the context
  strongly and greedy runs use mostly distinct ids, tied or untied.
  `make_model_dir` uses 0.1 for tied models unless told otherwise: with tied embeddings at 0.02
  the last token's own embedding wins and the model repeats its input.
- `output_scale` multiplies the final norm's weight in the saved checkpoint, which multiplies
  every logit; transformers loads the same weights, so the reference agrees. It widens the
  logits' spread, so the top two logits are typically units apart, far beyond the rounding of
  bf16 or a different kernel, and greedy choices do not flip.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

BUILTIN_VERSION = "v1"
_SPECIAL_TOKENS = ("<s>", "</s>", "<pad>")
_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<s>{{ message['role'] }}\n{{ message['content'] }}</s>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant\n{% endif %}"
)
_TINY = dict(  # test-sized defaults; every field can be overridden
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=4096,
)
_BUILTIN = dict(
    hidden_size=256,
    intermediate_size=704,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=4,
    max_position_embeddings=4096,
    tie_word_embeddings=False,
    initializer_range=0.1,  # see the module docstring
)
_BUILTIN_OUTPUT_SCALE = 8.0  # spreads the logits: see the module docstring


def _config_class(arch: str) -> Any:
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    classes = {"llama": LlamaConfig, "mistral": MistralConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config}
    if arch not in classes:
        raise ValueError(f"arch {arch!r} is unknown; choose one of {sorted(classes)}")
    return classes[arch]


def make_model_dir(
    path: str | Path,
    arch: str = "llama",
    seed: int = 0,
    output_scale: float = 1.0,
    **config_overrides: Any,
) -> Path:
    """Write a random-weight model of `arch` (llama, mistral, qwen2, qwen3) to `path`.

    The same seed and overrides give byte-identical safetensors. `config_overrides` are HF
    config fields (e.g. tie_word_embeddings=True, attention_bias=True, rope_parameters={...}).
    """
    from transformers import AutoModelForCausalLM

    fields = {**_TINY, **config_overrides}
    if fields.get("tie_word_embeddings") and "initializer_range" not in fields:
        fields["initializer_range"] = 0.1
    config = _config_class(arch)(**fields)
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        _perturb_norms_and_biases(model)
        model.model.norm.weight.mul_(output_scale)
    path = Path(path)
    model.save_pretrained(path)
    return path


def _perturb_norms_and_biases(model: torch.nn.Module) -> None:
    """Norm weights start at 1 and biases at 0; make them random too, so that a model that
    drops or misplaces one of them cannot match the reference by accident."""
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            param.mul_(1 + 0.2 * torch.randn_like(param))
        elif name.endswith(".bias"):
            param.copy_(0.1 * torch.randn_like(param))


def builtin_model_path(cache_dir: str | Path | None = None) -> Path:
    """The built-in small model's directory, created once under the cache root
    (`cached_model_dir`), in `<root>/builtin-<version>`."""
    return cached_model_dir(f"builtin-{BUILTIN_VERSION}", _build_builtin, cache_dir)


def cached_model_dir(name: str, build: Callable[[Path], None], cache_dir: str | Path | None = None) -> Path:
    """`<root>/<name>`, written by `build(directory)` the first time it is asked for.

    The cache root is `cache_dir`, else $PAGEFLEET_CACHE_DIR, else ~/.cache/pagefleet. The
    model is built in a temporary sibling directory and renamed into place, so concurrent
    callers never see half a model.
    """
    root = Path(cache_dir or os.environ.get("PAGEFLEET_CACHE_DIR") or "~/.cache/pagefleet")
    target = root.expanduser() / name
    if (target / "config.json").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        build(tmp)
        os.rename(tmp, target)
    except OSError:
        if not (target / "config.json").exists():  # not a lost race: a real failure
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _build_builtin(path: Path) -> None:
    tokenizer = train_builtin_tokenizer()
    tokenizer.save_pretrained(path)
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in _SPECIAL_TOKENS}
    make_model_dir(
        path,
        arch="llama",
        seed=0,
        output_scale=_BUILTIN_OUTPUT_SCALE,
        vocab_size=len(tokenizer),
        bos_token_id=ids["<s>"],
        eos_token_id=ids["</s>"],
        pad_token_id=ids["<pad>"],
        **_BUILTIN,
    )


def train_builtin_tokenizer(vocab_size: int = 1024) -> Any:
    """Byte-level BPE trained on BUILTIN_TEXT, wrapped for transformers (with chat template)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=1,  # the text is small: let rarer pairs merge too
        special_tokens=list(_SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(BUILTIN_TEXT.splitlines(), trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        chat_template=_CHAT_TEMPLATE,
    )


BUILTIN_TEXT = """\
The library opens at nine in the morning and closes at six in the evening.
Readers come to find books, to study, and to ask questions about the world.
A good question is short and clear, and a good answer tells you where it came from.
The river runs past the old mill, under the stone bridge, and out to the sea.
In spring the fields are green, in summer they are gold, and in autumn they are brown.
Winter brings snow to the hills and long quiet nights to the town.
A computer reads instructions one after another and does exactly what they say.
Memory holds the numbers a program is working on; the disk keeps them when the power is off.
A network carries messages between machines, a little at a time, in small packets.
When many people ask the same question, it is faster to remember the answer than to work it out again.
The cache keeps recent results close at hand, and forgets the oldest ones when it runs out of room.
A page is a fixed number of slots; a table says which page holds which part of a long list.
Every sentence is made of words, and every word is made of letters.
The model reads the words it has seen so far and guesses the next one.
It is not always right, but it learns from many examples which words tend to follow which.
Some questions are about history: who built the bridge, when the mill was closed, why the river moved.
Other questions are about numbers: how many books are on the shelf, how long the journey takes.
A map shows roads, rivers, towns and hills, and the scale tells you how far apart they are.
The baker starts work before dawn, mixing flour, water, salt and yeast into dough.
Bread rises in a warm room, and the smell of it fills the street by seven o'clock.
Children walk to school in groups, talking about games, friends and the weather.
The teacher writes a problem on the board and asks the class to solve it together.
Mathematics is the study of patterns: numbers, shapes, changes and chances.
Two plus two is four, three times three is nine, and ten divided by two is five.
Science asks how things work and checks every idea against careful measurement.
A good experiment changes one thing at a time and writes down everything it sees.
The weather today is cloudy with a chance of rain in the afternoon and wind from the west.
Tomorrow should be sunny and warm, a fine day for a walk along the coast.
The train leaves the station at a quarter past eight and arrives in the city at ten.
Passengers read, sleep, look out of the window, or talk quietly with their neighbours.
Music is sound arranged in time: rhythm, melody and harmony working together.
A story has a beginning, a middle and an end, and someone we care about in it.
Please summarise the document in three sentences and list the names it mentions.
What is the main idea of the second paragraph, and how does the author support it?
Thank you for your question. Here is a short answer, followed by the details.
The user asked for help, and the assistant replied with a clear and friendly answer.
Hello! How can I help you today? I can answer questions, write summaries and explain ideas.
Long documents are split into chunks, and each chunk is read once and remembered for later.
Servers share the work: each one takes a part of the requests and reports how busy it is.
If one server already holds the start of a document, it should answer the questions about it.
Tokens are the small pieces of text that a model reads: whole words, parts of words, or single letters.
The quick brown fox jumps over the lazy dog, and the dog does not seem to mind at all.
Gardens need water, light and patience; weeds need nothing at all and grow anyway.
The market sells apples, pears, plums, cheese, eggs, fish and fresh flowers on Saturdays.
A kitchen table, four chairs, a lamp, a shelf of cups and a window facing the garden.
The old clock in the hall strikes every hour, and the house is quiet between the strikes.
Ships come into the harbour at high tide, and the gulls follow them, calling loudly.
At night the stars come out one by one, and the moon rises slowly over the hills.
"""
