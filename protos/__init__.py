"""The .proto files and their generated Python modules."""
