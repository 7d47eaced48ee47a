import pytest

from megatron_rlvr.config import TinyModel

VOCAB = 96  # divisible by every tensor-parallel size the tests use


@pytest.fixture(scope="session")
def tiny_hf_dir(tmp_path_factory):
    """A random tiny Qwen3-MoE (2 layers, 4 experts, top-2) saved as an HF checkpoint."""
    from megatron_rlvr.tiny_model import build_tiny_hf_model

    return build_tiny_hf_model(TinyModel(), tmp_path_factory.mktemp("tiny-qwen3-moe"), VOCAB)


@pytest.fixture(scope="session")
def family_dir(tmp_path_factory):
    """name → a tiny random HF checkpoint of that MoE family (tests/tiny_families.py), built
    once per session when a test first asks."""
    from tiny_families import build_family

    built = {}

    def get(name: str):
        if name not in built:
            built[name] = build_family(name, tmp_path_factory.mktemp(f"tiny-{name}"))
        return built[name]

    return get
