"""Config tree: shipped configs load, overrides apply, every bad input is one named line."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from megatron_rlvr.config import ConfigError, load_config, to_yaml

REPO = Path(__file__).resolve().parents[1]
SHIPPED = sorted((REPO / "configs").glob("*.yaml"))
TINY = REPO / "configs" / "tiny-moe-cpu.yaml"


def test_there_are_shipped_configs():
    assert TINY in SHIPPED


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
def test_every_shipped_config_loads(path, shipped_overrides):
    cfg = load_config(path, shipped_overrides(path))
    assert cfg.algo.clip_low is not None and cfg.parallel.etp is not None


def test_defaults_resolve_per_loss_kind():
    grpo = load_config(TINY)
    gspo = load_config(TINY, ["algo.kind=gspo"])
    assert (grpo.algo.clip_low, grpo.algo.clip_high) == (0.2, 0.28)
    assert (gspo.algo.clip_low, gspo.algo.clip_high) == (3e-4, 4e-4)
    explicit = load_config(TINY, ["algo.kind=gspo", "algo.clip_high=1e-3"])
    assert explicit.algo.clip_high == 1e-3


def test_overrides_and_derived_layout():
    cfg = load_config(TINY, ["parallel.ep=2", "algo.routing_replay=r3", "trainer.output_dir=/tmp/x"])
    assert (cfg.parallel.ep, cfg.parallel.dp, cfg.parallel.etp) == (2, 2, 1)
    assert cfg.rollout.return_routed_experts is True
    assert cfg.trainer.output_dir == "/tmp/x"
    tp = load_config(TINY, ["parallel.tp=2"])
    assert tp.parallel.sequence_parallel is True and tp.parallel.etp == 2 and tp.parallel.dp == 1
    assert load_config(TINY).weight_sync.backend == "gloo"


def test_one_seed_varies_the_problems_the_sampling_and_the_evaluation(tmp_path):
    """trainer.seed alone must vary everything a seed should: runs reported as "3 seeds" that
    varied data.seed only were sampled and scored alike."""
    cfg = load_config(TINY, ["trainer.seed=7"])
    assert (cfg.trainer.seed, cfg.data.seed, cfg.eval.seed) == (7, 7, 7)
    given = load_config(TINY, ["trainer.seed=7", "data.seed=3", "eval.seed=5"])
    assert (given.data.seed, given.eval.seed) == (3, 5)  # what the config gives stays
    assert load_config(TINY, ["trainer.seed=7", "data.seed=0"]).data.seed == 0
    assert load_config(TINY, ["trainer.seed=7", "data.type=long_answers"]).data.seed == 7
    (tmp_path / "resolved.yaml").write_text(to_yaml(cfg))
    assert load_config(tmp_path / "resolved.yaml") == cfg  # the resolved file keeps the seeds it was run with


def test_resolved_yaml_round_trips(tmp_path):
    cfg = load_config(TINY, ["algo.kind=gspo", "parallel.ep=2"])
    path = tmp_path / "resolved.yaml"
    path.write_text(to_yaml(cfg))
    assert load_config(path) == cfg


def _problems(overrides, path=TINY):
    with pytest.raises(ConfigError) as err:
        load_config(path, overrides)
    return err.value.problems


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (["parallel.ep=3"], "parallel.ep = 3: must divide the model's 4 experts"),
        (["parallel.tp=2", "parallel.sequence_parallel=false"], "parallel.sequence_parallel = false"),
        (["parallel.tp=3"], "parallel.tp = 3: must divide the attention heads"),
        (["parallel.pp=3"], "parallel.pp = 3: must divide the 2 layers"),
        (["algo.clip_low=1.5"], "algo.clip_low = 1.5: must be in (0, 1)"),
        (["algo.clip_high=-0.1"], "algo.clip_high = -0.1"),
        (["algo.clip_ratio_c=0.5"], "algo.clip_ratio_c = 0.5: must be > 1"),
        (["algo.kind=gspo", "algo.clip_ratio_c=3"], "dual clip is for kind grpo"),
        (["algo.tis_cap=0.5"], "algo.tis_cap: moved to algo.rollout_correction.rollout_is_threshold"),
        (["algo.routing_replay=r3", "rollout.return_routed_experts=false"], "rollout.return_routed_experts = false"),
        (["algo.kind=ppo"], "algo.kind = 'ppo'"),
        (["algo.clip_lo=0.1"], "algo.clip_lo: unknown field (did you mean clip_low?)"),
        (["model.num_layrs=3"], "model.num_layrs: unknown field (did you mean num_layers?)"),
        (["rollout.engine.tpp=2"], "rollout.engine.tpp: unknown field"),
        (["rollout.n_samples_per_prompt=1"], "rollout.n_samples_per_prompt = 1"),
        (["rollout.engine.type=sglang"], "rollout.engine.device = cuda: a CPU learner (parallel.device = cpu)"),
        (["weight_sync.backend=nccl"], "weight_sync.backend = nccl"),
        (["model.num_experts_per_tok=8"], "model.num_experts_per_tok = 8"),
        (["algo.num_minibatches=3"], "algo.num_minibatches = 3"),
        (["trainer.lr=abc"], "trainer.lr = 'abc'"),
        (["trainer.min_lr=1"], "trainer.min_lr = 1.0"),
        (["nosuchsection.x=1"], "nosuchsection: unknown field"),
        (["parallel=3"], "parallel = 3"),
        (["algo.kind"], "expected dotted.key=value"),
        (["verifier.kind=chemistry"], "verifier.kind = 'chemistry': unknown verifier (known: math, code, ifeval)"),
        (["verifier.by_data_source={openai/gsm8k: mth}"], "verifier.by_data_source.openai/gsm8k = 'mth': unknown"),
        (["verifier.functions={math: 'a:b'}"], "verifier.functions.math: 'math' is a built-in verifier"),
        (["verifier.functions={mine: 'just_a_module'}"], "verifier.functions.mine = 'just_a_module': expected"),
        (
            ["data.type=file", "data.path=[a.jsonl, b.jsonl]", "data.weights=[1]"],
            "data.weights = [1.0]: one weight per file in data.path (2)",
        ),
        (
            ["eval.sets.held.type=file", "eval.sets.held.path=a.jsonl", "eval.sets.held.weights=[0]"],
            "eval.sets.held.weights = [0.0]: every weight must be > 0",
        ),
        (["data.type=file"], "data.path: required field is missing"),
        (["data.type=file", "data.path=a.jsonl", "data.format=openrlhf"], "data.format = 'openrlhf'"),
        (["eval.n_samples=2", "eval.pass_k=[1, 4]"], "eval.pass_k = [1, 4]: k must be <= eval.n_samples (2)"),
        (["logging.wandb.mode=offline"], "logging.wandb.project: required field is missing"),
    ],
)
def test_errors_name_the_field(overrides, expected):
    problems = _problems(overrides)
    assert any(expected in line for line in problems), problems
    assert all("\n" not in line for line in problems)


def test_every_problem_is_reported_not_just_the_first():
    problems = _problems(["algo.clip_low=2", "trainer.steps=0", "rollout.temperature=-1"])
    assert len(problems) == 3


def test_hf_model_path_errors(tmp_path):
    base = [f"model={{type: hf, path: {tmp_path}}}"]
    assert "no config.json" in _problems(base)[0]
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    assert (
        "model_type 'llama' in config.json is not supported (supported: deepseek_v3, glm4_moe, gpt_oss, kimi_k2, "
        "mixtral, qwen2_moe, qwen3_moe)"
    ) in _problems(base)[0]
    (tmp_path / "config.json").write_text(
        json.dumps(
            {
                "model_type": "qwen3_moe",
                "num_hidden_layers": 4,
                "num_attention_heads": 8,
                "num_key_value_heads": 4,
                "num_experts": 8,
                "num_experts_per_tok": 2,
            }
        )
    )
    assert load_config(TINY, base + ["parallel.ep=8"]).parallel.dp == 8
    assert "must divide the model's 8 experts" in _problems(base + ["parallel.ep=3"])[0]


def test_bad_files(tmp_path):
    assert "config file" in _problems([], tmp_path / "missing.yaml")[0]
    broken = tmp_path / "broken.yaml"
    broken.write_text("algo:\n  kind: [grpo\n")
    assert "line" in _problems([], broken)[0] and "not valid YAML" in _problems([], broken)[0]
    scalar = tmp_path / "scalar.yaml"
    scalar.write_text("42\n")
    assert "top level must be a mapping" in _problems([], scalar)[0]


def _cli(*args):
    return subprocess.run(
        [sys.executable, "-m", "megatron_rlvr.cli", *args], capture_output=True, text=True, cwd=REPO, timeout=120
    )


def test_cli_dry_run_prints_resolved_yaml():
    out = _cli("train", str(TINY), "--dry-run", "algo.kind=gspo", "parallel.ep=2")
    assert out.returncode == 0, out.stderr
    resolved = yaml.safe_load(out.stdout)
    assert resolved["algo"]["kind"] == "gspo" and resolved["algo"]["clip_low"] == 3e-4
    assert resolved["parallel"]["dp"] == 2


def test_cli_malformed_config_is_one_line_exit_2_no_traceback():
    out = _cli("train", str(TINY), "parallel.ep=3", "--dry-run")
    assert out.returncode == 2
    assert "Traceback" not in out.stderr
    # only what the user got wrong: not also the mini-batch split that dp (derived from ep) breaks
    assert out.stderr.strip().splitlines() == ["config error: parallel.ep = 3: must divide the model's 4 experts"]


def test_a_dotted_override_can_switch_a_section_to_another_kind():
    cfg = load_config(TINY, ["data.type=file", "data.path=/data/math.jsonl"])  # the YAML's data is arithmetic
    assert cfg.data.type == "file" and cfg.data.path == "/data/math.jsonl"
    kept = load_config(TINY, ["data.type=arithmetic"])  # the same kind: the YAML's fields stay
    assert kept.data.max_operand == load_config(TINY).data.max_operand


def test_cli_version():
    out = _cli("--version")
    assert out.returncode == 0 and out.stdout.startswith("megatron-rlvr ")


def test_a_dotted_type_override_switches_the_section_s_kind():
    # the YAML's data section is written for the arithmetic kind (num_prompts, max_operand, seed)
    cfg = load_config(
        TINY, ["data.path=/x/train.parquet", "data.type=file", "data.format=verl", "data.system_prompt=Be brief."]
    )
    assert cfg.data.type == "file" and cfg.data.path == "/x/train.parquet"
    assert (cfg.data.prompt_key, cfg.data.answer_key, cfg.data.verifier_key, cfg.data.id_key) == (
        "prompt",
        "reward_model.ground_truth",
        "ability",
        "extra_info.index",
    )
    assert cfg.data.system_prompt == "Be brief." and cfg.data.seed == 0  # seed: both kinds have it
    plain = load_config(TINY, ["data.type=file", "data.path=a.jsonl", "data.answer_key=solution.final"])
    assert (plain.data.prompt_key, plain.data.answer_key) == ("prompt", "solution.final")
    engine = load_config(TINY, ["rollout.engine.type=cpu", "rollout.engine.dtype=bfloat16"])
    assert engine.rollout.engine.dtype == "bfloat16"  # the same kind keeps its fields


def test_experts_replicated_over_part_of_the_tensor_parallel_group_are_refused():
    """tp 2 with etp 1 and ep 1 trains experts on partial gradients (logprobs after one step 0.2
    from world 1's); etp = tp, or ep covering the TP ranks, train as world 1 does."""
    with pytest.raises(
        ConfigError, match=r"parallel.ep = 1, parallel.etp = 1: with parallel.tp = 2, ep · etp must be >= tp"
    ):
        load_config(None, ["parallel.tp=2", "parallel.etp=1"])
    assert load_config(None, ["parallel.tp=2", "parallel.ep=2", "parallel.etp=1"]).parallel.etp == 1
    assert load_config(None, ["parallel.tp=2"]).parallel.etp == 2
