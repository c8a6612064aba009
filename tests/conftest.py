import os
import socket
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
os.environ["HF_HUB_OFFLINE"] = "1"  # tests never reach for the hub; a hub id fails at once


@pytest.fixture(scope="session")
def tiny():
    """Random tiny Qwen2 models (tied and untied embeddings) with a locally trained tokenizer,
    built once."""
    import prepare
    return {"tied": prepare.build_tiny(os.path.join(ROOT, "data/tiny")),
            "untied": prepare.build_tiny(os.path.join(ROOT, "data/tiny-untied"), tie=False)}


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
