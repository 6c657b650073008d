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


INTEGRATION_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "integration")


def pytest_collection_modifyitems(config, items):
    """Every test under tests/integration/ is in the integration lane, whether or not its file says
    so, so the fast lane (-m "not integration and not slow") never starts Ray, Redis or the real target."""
    for item in items:
        if os.path.commonpath([str(item.path), INTEGRATION_DIR]) == INTEGRATION_DIR:
            item.add_marker("integration")
