from pathlib import Path

import pytest

from megatron_rlvr.config import TinyModel

REPO = Path(__file__).resolve().parents[1]
# where runs started from the clone write by default (every shipped config's trainer.output_dir,
# compare-replay's and convert's outputs): a user's runs live here, so tests never touch them
USER_OUTPUT_DIRS = ("runs", "outputs")

VOCAB = 96  # divisible by every tensor-parallel size the tests use


# modules that count the code sandbox's processes or folders machine-wide: under pytest-xdist
# they share one worker, so one module's sandboxes never show up in another's count
SANDBOX_COUNTING_MODULES = {"test_code_attacks", "test_code_verifier", "test_errors", "test_sandbox_pool"}


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's own, which reads the groups into the test ids
def pytest_collection_modifyitems(config, items):
    """`gpu` tests (opt-in: -m gpu) skip, saying why, where torch sees no CUDA device. On a GPU
    machine whose torch cannot use it, scripts/gpu_check.py stops at its inventory step first.

    Under pytest-xdist (the README's test command: `-n 2 --dist loadgroup`) the tests of a module
    that use one of its module-scoped fixtures (an engine server, a comparison) run on one worker,
    so the fixture is built once; every other test goes to whichever worker is free."""
    import torch

    if config.pluginmanager.hasplugin("xdist"):
        for item in items:
            module = item.module.__name__
            if module in SANDBOX_COUNTING_MODULES:
                item.add_marker(pytest.mark.xdist_group("sandbox"))
            elif _uses_a_module_fixture(item):
                item.add_marker(pytest.mark.xdist_group(module))
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device; torch sees none")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def _uses_a_module_fixture(item) -> bool:
    return any(defs[-1].scope == "module" for defs in item._fixtureinfo.name2fixturedefs.values() if defs)


def _user_outputs() -> dict[str, float]:
    """Every path under the clone's user output folders, two levels deep, with its mtime."""
    found = {}
    for name in USER_OUTPUT_DIRS:
        root = REPO / name
        for path in [root, *root.glob("*"), *root.glob("*/*")] if root.exists() else []:
            found[str(path.relative_to(REPO))] = path.stat().st_mtime
    return found


@pytest.fixture(autouse=True)
def leaves_user_runs_alone():
    """Fails a test that wrote into the clone's runs/ or outputs/: every test keeps its outputs
    under tmp_path (a run the user left there must neither be changed nor change a result)."""
    before = _user_outputs()
    yield
    after = _user_outputs()
    changed = sorted(set(before) ^ set(after) | {p for p in before.keys() & after.keys() if before[p] != after[p]})
    assert not changed, f"the test wrote into the clone's own output folders: {changed[:5]}"


@pytest.fixture(scope="session")
def tiny_hf_dir(tmp_path_factory):
    """A random tiny Qwen3-MoE (2 layers, 4 experts, top-2) saved as an HF checkpoint."""
    from megatron_rlvr.tiny_model import build_tiny_hf_model

    return build_tiny_hf_model(TinyModel(), tmp_path_factory.mktemp("tiny-qwen3-moe"), VOCAB)


# shipped configs that start from another command's output (the long-answer and tool demos' RL
# stages take their cold start's export): checked with a model folder made here in its place
STARTS_FROM_AN_EXPORT = {
    "long-answers-cpu.yaml",
    "compare-replay-long-cpu.yaml",
    "tool-calculator-cpu.yaml",
    "tool-calculator-direct-cpu.yaml",
}


@pytest.fixture(scope="session")
def shipped_overrides(tiny_hf_dir):
    """config path → the overrides a shipped config needs to load in a test."""
    return lambda path: [f"model.path={tiny_hf_dir}"] if Path(path).name in STARTS_FROM_AN_EXPORT else []


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


def build_tiny_gpt_oss(out_dir, *, rope: str = "yarn", seed: int = 0):
    """A random tiny gpt-oss (2 layers: sliding window 4, then full attention; 4 experts,
    top-2) saved as an HF checkpoint. Every weight is drawn afresh, biases and attention sinks
    included (transformers initialises some to zero), so each takes part; YaRN as gpt-oss
    ships it (factor, beta, truncate false) at a small original context."""
    import torch
    from transformers import GptOssConfig, GptOssForCausalLM

    rope_parameters = (
        {"rope_type": "default", "rope_theta": 10000.0}
        if rope == "default"
        else {
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 8.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": 64,
        }
    )
    config = GptOssConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=4,
        max_position_embeddings=512,
        rope_parameters=rope_parameters,
        tie_word_embeddings=False,
        router_aux_loss_coef=0.0,
    )
    torch.manual_seed(seed)
    model = GptOssForCausalLM(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.normal_(1.0, 0.1)
            else:
                param.normal_(0.0, 0.3 if "sinks" in name else 0.1)
    model.save_pretrained(out_dir)
    return out_dir


@pytest.fixture(scope="session")
def tiny_gpt_oss_dir(tmp_path_factory):
    return build_tiny_gpt_oss(tmp_path_factory.mktemp("tiny-gpt-oss"))
