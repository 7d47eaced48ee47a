"""One learner rank of a supervised run: the RL learner rank without the weight syncer (an
SFT run has no engines), plus the SFT step and the HF export of the final model."""

from __future__ import annotations

from pathlib import Path

from megatron_rlvr.launch.learners import LearnerRank
from megatron_rlvr.learner.batch import TrainBatch


class SftRank(LearnerRank):
    def setup(
        self, master: tuple[str, int], engine_urls: list[str] | None = None, api_key: str | None = None
    ) -> int | None:
        """Joins the world and builds this rank's model shard."""
        from megatron_rlvr.config import ConfigError
        from megatron_rlvr.learner.learner import Learner
        from megatron_rlvr.learner.model import uses_transformer_engine
        from megatron_rlvr.learner.parallel import Rendezvous, init_parallel

        packs = self.cfg.sft is not None and self.cfg.sft.pack_sequences
        if packs and uses_transformer_engine(self.cfg.parallel.device):
            raise ConfigError(
                [
                    "sft.pack_sequences = true: the block-diagonal mask runs on the local attention; "
                    "transformer-engine's ignores it (set sft.pack_sequences=false)"
                ]
            )
        init_parallel(self.cfg.parallel, Rendezvous(self.rank, self.world_size, *master), seed=self.cfg.trainer.seed)
        self.joined = True
        self.learner = Learner(self.cfg, self.model_dir)
        return None

    def sft_step(self, micro: list[TrainBatch], train: bool) -> dict[str, float]:
        return self.learner.sft_step(micro, train=train)

    def export(self, out_dir: str) -> None:
        export_hf_folder(self.learner, self.model_dir, out_dir, write=self.rank == 0)


def export_hf_folder(learner, model_dir: str | Path, out_dir: str | Path, *, write: bool) -> None:
    """Collective: every rank draws the learner's export; the one that writes (rank 0) puts
    it in out_dir as safetensors, beside the config and tokenizer of model_dir (the model the
    run started from): a folder an RL run's model.path takes."""
    from megatron_rlvr.convert.hf_files import ShardedSafetensors, copy_side_files

    writer = ShardedSafetensors(out_dir, max_bytes=2**30) if write else None
    if writer is not None:
        copy_side_files(model_dir, out_dir)
        for stale in Path(out_dir).glob("model*.safetensors"):
            stale.unlink()
    for name, tensor in learner.export_hf():
        if writer is not None:
            writer.add(name, tensor)
    if writer is not None:
        writer.close()
