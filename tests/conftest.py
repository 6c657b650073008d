"""Process-wide test settings: never reach a model hub, keep torch to one thread.

Set before anything imports transformers / huggingface_hub (they read these once, on import).
"""

import os

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

# The machines are small and shared; the test models are tiny, so one thread is also the fastest.
torch.set_num_threads(1)
