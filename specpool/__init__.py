"""specpool: lossless speculative decoding with a pool of drafters.

One installed name, in one-way layers (docs/ARCHITECTURE.md): ``core`` (errors, defaults,
limits; torch-free) → ``target`` → ``drafters`` → ``router`` → ``learning`` → ``v1`` (generated
protos) → ``services`` → ``cli``. A module imports only from its own layer or those below it;
``tests/unit/test_layers.py`` holds the contract.
"""

__version__ = "0.1.0"
