"""What `pagefleet demo` asks: a short real document and questions about it, as chat messages.
The tests ask the default model the same questions against transformers."""

from __future__ import annotations

DEMO_DOCUMENT = (
    "The Eiffel Tower is a wrought-iron lattice tower on the Champ de Mars in Paris, France. "
    "It is named after the engineer Gustave Eiffel, whose company designed and built the tower "
    "between 1887 and 1889 as the entrance arch to the 1889 World's Fair. It is 330 metres tall, "
    "about the height of an 81-storey building, and was the tallest man-made structure in the "
    "world until the Chrysler Building in New York City was finished in 1930. The tower has three "
    "levels for visitors, with restaurants on the first and second levels. About seven million "
    "people visit it every year, and it is repainted every seven years to protect it from rust."
)
DEMO_QUESTIONS = (
    "Who is the Eiffel Tower named after?",
    "In which city is the Eiffel Tower?",
    "How tall is the Eiffel Tower?",
    "When was the tower built?",
    "What is the tower made of?",
    "Which building became taller than the tower in 1930?",
    "How many people visit the tower every year?",
    "How often is the tower repainted?",
)


def demo_messages(question: str) -> list[dict]:
    """A question about the demo document as chat messages: the document first (in the system
    message), so that every question shares it as a prefix."""
    system = f"Answer the question using this document.\n\n{DEMO_DOCUMENT}"
    return [{"role": "system", "content": system}, {"role": "user", "content": question}]
