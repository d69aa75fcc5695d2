"""Run-level plumbing the RL loop calls: build, resume, rollouts by id, save, log, stop.

Kept out of ``train.py`` so the loop reads top to bottom. ``RunContext`` is the
one object holding run state that is not the model: the tracker (driver only),
the wall clock, the checkpoint root and the colocation choreography.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Optional

import torch.distributed as dist

from megatron_rl.errors import ConfigError
from megatron_rl.infra.tracking import Tracker
from megatron_rl.infra.wall_time import WallClock

log = logging.getLogger("megatron_rl")

CONSOLE_KEYS = ["rollout/reward_mean", "eval/reward_mean", "train/pg_loss", "train/kl", "train/entropy",
                "train/grad_norm", "train/mismatch_abs_logprob", "rollout/response_len_mean", "perf/step_time_s"]


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def build_spec(cfg):
    """Map the algorithm flags onto the algorithm package's frozen config.

    ``--loss-agg-mode`` unset passes None: the algorithm config picks the estimator's
    default (seq_mean_token_mean for GSPO, token_mean otherwise).
    """
    from megatron_rl.algorithms.config import PolicyGradientConfig
    from megatron_rl.algorithms.spec import PolicyGradientSpec

    a = cfg.algorithm
    estimator = "grpo" if a.advantage_estimator == "gspo" else a.advantage_estimator
    temperature = cfg.rollout.rollout_temperature or 1.0  # greedy rollouts: log-probs at temperature 1
    return PolicyGradientSpec(PolicyGradientConfig(
        advantage_estimator=estimator, use_gspo=a.advantage_estimator == "gspo",
        grpo_std_normalization=not a.disable_grpo_std_normalization, loss_agg_mode=a.loss_agg_mode,
        normalize_advantages=a.normalize_advantages, use_unbiased_kl=a.use_unbiased_kl,
        max_response_length=cfg.rollout.rollout_max_response_len, eps_clip=a.eps_clip,
        eps_clip_high=a.eps_clip_high, eps_clip_c=a.eps_clip_c,
        kl_loss_coef=a.kl_loss_coef if a.use_kl_loss else 0.0, kl_loss_type=a.kl_loss_type,
        entropy_coef=a.entropy_coef, use_tis=a.use_tis, tis_cap=a.tis_cap, tis_clip_low=a.tis_clip_low,
        use_rollout_logprobs=a.use_rollout_logprobs, opd_coef=a.opd_kl_coef,
        temperature=temperature, logprob_chunk_size=cfg.batching.log_probs_chunk_size))


def build_rollout(cfg):
    """The driver's rollout side: engine, prompt data, reward."""
    from megatron_rl.data.prompts import PromptDataset, PromptIterator
    from megatron_rl.rollout.embedded import EmbeddedEngine
    from megatron_rl.rollout.manager import RolloutManager
    from megatron_rl.rollout.rewards import get_reward_fn

    if cfg.rollout.rollout_backend != "embedded":
        raise ConfigError("--rollout-backend sglang is not wired into the loop yet; use --rollout-backend embedded")
    if not cfg.data.prompt_data:
        raise ConfigError("a rollout needs prompts: give --prompt-data FILE.jsonl")
    reward_fn = get_reward_fn(rm_type=cfg.data.rm_type, custom_rm_path=cfg.data.custom_rm_path)  # fail fast
    engine = EmbeddedEngine(cfg.model.hf_checkpoint)
    d, b = cfg.data, cfg.batching
    common = dict(tokenizer=engine.tokenizer, input_key=d.input_key, label_key=d.label_key,
                  apply_chat_template=d.apply_chat_template, max_prompt_len=cfg.rollout.rollout_max_prompt_len)
    prompts = PromptIterator(PromptDataset(d.prompt_data, **common), rollout_batch_size=b.rollout_batch_size,
                             n_samples_per_prompt=b.n_samples_per_prompt, shuffle=d.rollout_shuffle,
                             seed=cfg.rollout.rollout_seed)
    eval_dataset = PromptDataset(d.eval_prompt_data, **common) if d.eval_prompt_data else None
    return RolloutManager(cfg, engine, prompts, reward_fn, eval_dataset)


@dataclass
class Colocation:
    """Memory hand-over between trainer and engine when they share accelerators (``--colocate``).

    Off (separate placement): nothing moves. On: the engine drops its weights
    before training and the trainer offloads before the engine resumes; the
    engine then gets a complete weight update (the sync that follows). On CPU the
    same calls run; they just free host memory.
    """

    offload_train: bool
    offload_rollout: bool

    def before_train(self, backend, rollout) -> None:
        if self.offload_rollout and rollout is not None:
            rollout.engine.release()
        if self.offload_train:
            backend.wake()

    def before_rollout(self, backend, rollout) -> None:
        if self.offload_train:
            backend.sleep()
        if self.offload_rollout and rollout is not None:
            rollout.engine.resume()


@dataclass
class RunContext:
    cfg: object
    tracker: Tracker
    clock: WallClock
    colocation: Colocation
    is_driver: bool
    resume_state: dict = field(default_factory=dict)
    # (step, path) of the checkpoint this process last resumed from or saved: the rollout that follows it
    # is written to / read from rollout_ckpts/ (see rollout/rollout_ckpt.py); resumed_at: the resumed step
    last_checkpoint: Optional[tuple] = None
    resumed_at: Optional[int] = None

    @classmethod
    def create(cls, cfg) -> "RunContext":
        rank = int(os.environ.get("RANK", "0"))
        rt = cfg.runtime
        from megatron_rl.infra.checkpoint_root import read_resume_state

        if rank == 0 and cfg.checkpoint.existing_save and cfg.checkpoint.no_auto_resume:
            from megatron_rl.infra.fresh_start import clear_save_root

            clear_save_root(cfg.checkpoint.save, cfg.checkpoint.existing_save)  # validation allowed this start
        resumable = cfg.checkpoint.save and not cfg.checkpoint.no_auto_resume
        state = (read_resume_state(cfg.checkpoint.save) or {}) if resumable else {}
        clock = WallClock(rt.wall_time_limit, rt.wall_time_reserve, elapsed_before_s=state.get("elapsed_s", 0.0))
        clock.install_signal_handlers()
        tracker = Tracker(rt.output_dir, enabled=rank == 0, tensorboard_dir=rt.tensorboard_dir,
                          wandb_project=rt.wandb_project, wandb_group=rt.wandb_group, wandb_mode=rt.wandb_mode,
                          wandb_resume_id=rt.wandb_resume_id or state.get("wandb_run_id"),
                          config=cfg.to_dict(), console_keys=CONSOLE_KEYS)
        m = cfg.memory
        return cls(cfg, tracker, clock, Colocation(m.effective_offload_train, m.effective_offload_rollout),
                   is_driver=rank == 0, resume_state=state)

    # ---- logging / schedule ---------------------------------------------------
    def log(self, step: int, metrics: dict) -> None:
        self.tracker.log(step, metrics)

    def eval_due(self, rollout_id: int) -> bool:
        every = self.cfg.data.eval_interval
        last = rollout_id + 1 == self.cfg.rollout.num_rollout
        return every is not None and ((rollout_id + 1) % every == 0 or last) and self.clock.can_eval()

    def save_due(self, rollout_id: int) -> bool:
        every = self.cfg.checkpoint.save_interval
        return bool(self.cfg.checkpoint.save) and every is not None and (rollout_id + 1) % every == 0

    def should_stop(self) -> bool:
        # every rank must agree (a signal may reach one rank only)
        import torch

        flag = torch.tensor([1.0 if self.clock.should_stop() else 0.0])
        if dist.is_initialized():
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    # ---- rollouts by id ----------------------------------------------------------
    def get_rollout(self, rollout_id: int, rollout):
        from megatron_rl.rollout.manager import load_rollout, save_rollout

        mode = self.cfg.mode
        if not self.is_driver:
            return None, {}
        if mode.load_debug_rollout_data:
            samples = load_rollout(mode.load_debug_rollout_data.format(rollout_id=rollout_id))
            metrics = {"rollout/reward_mean": sum(s.reward for s in samples) / len(samples)}
        else:
            samples, metrics = self._generate_or_reload(rollout_id, rollout)
        if mode.save_debug_rollout_data:
            save_rollout(mode.save_debug_rollout_data.format(rollout_id=rollout_id), rollout_id, samples)
        return samples, metrics

    def _generate_or_reload(self, rollout_id: int, rollout):
        """Rollout N from the engine, or from ``rollout_ckpts/rollout_N.pt`` when this job resumed from
        checkpoint N and the job before it had generated N already; a rollout that directly follows a
        checkpoint under --save is written there (rollout/rollout_ckpt.py says why only that one)."""
        from megatron_rl.rollout import rollout_ckpt

        root = self.cfg.checkpoint.save
        step, path = self.last_checkpoint or (None, None)
        follows = (path if root and step == rollout_id and self.cfg.has_training
                   and os.path.abspath(os.path.dirname(path)) == os.path.abspath(root) else None)
        if follows and self.resumed_at == rollout_id:
            stored = rollout_ckpt.load_rollout_ckpt(root, rollout_id, checkpoint=follows,
                                                    fingerprint=rollout.fingerprint(), state_before=rollout.position(),
                                                    weight_version=rollout.engine.weight_version)
            if stored is not None:
                rollout.load_state_dict(stored["state_after"])
                log.info("rollout %d: loaded from %s, not regenerated", rollout_id,
                         rollout_ckpt.rollout_ckpt_path(root, rollout_id))
                return stored["samples"], stored["metrics"]
        before = rollout.position()
        samples, metrics = rollout.generate(rollout_id)
        if follows:
            rollout_ckpt.save_rollout_ckpt(root, rollout_id, checkpoint=follows, samples=samples, metrics=metrics,
                                           fingerprint=rollout.fingerprint(), state_before=before,
                                           state_after=rollout.state_dict())
        return samples, metrics

    # ---- checkpoints -------------------------------------------------------------
    def resume_or_init(self, backend, rollout) -> int:
        """Snapshot the reference policy, then continue from the newest complete checkpoint if any."""
        from megatron_rl.convert.common import is_model_dir
        from megatron_rl.infra import checkpoint_root as ckpt

        cfg = self.cfg
        if cfg.checkpoint.ref_load:
            backend.load_frozen_weights("ref", cfg.checkpoint.ref_load)
        elif cfg.algorithm.use_kl_loss:
            backend.weights.backup("ref")  # the initial policy, before any resumed weights are loaded
        if cfg.checkpoint.opd_teacher_load:
            backend.load_frozen_weights("teacher", cfg.checkpoint.opd_teacher_load)
        # a model-only --load gave the initial weights (backend.initialize); resuming is from --save
        load_root = None if is_model_dir(cfg.checkpoint.load) else cfg.checkpoint.load
        root = load_root or cfg.checkpoint.save
        if not root or cfg.checkpoint.no_auto_resume:
            return 0
        if load_root and ckpt.iteration_of(load_root) is not None:
            path, extra = load_root, self._load_named(backend, load_root)
        else:
            found = self._load_newest_good(backend, root, named=bool(load_root))
            if found is None:
                return 0
            path, extra = found
        if rollout is not None and extra.get("dataset_state"):
            rollout.prompts.load_state_dict(extra["dataset_state"])
        step = int(extra["rollout_id"])
        log.info("resumed from %s at rollout %d", path, step)
        self.last_checkpoint, self.resumed_at = (step, path), step
        return step

    @staticmethod
    def _load_named(backend, path: str) -> dict:
        """``--load ROOT/iter_NNNNNNN``: exactly that checkpoint, or an error naming it (no fallback:
        the user chose it)."""
        from megatron_rl.errors import CheckpointError

        try:
            return backend.load(path)
        except CheckpointError as e:
            raise CheckpointError(f"--load {path} (named, so never swapped for another checkpoint): {e}") from e

    @staticmethod
    def _load_newest_good(backend, root: str, named: bool):
        """Auto-resume: the first of ``checkpoint_root.resume_candidates`` that passes the loader's
        checks, as (path, extra_state); None when the root holds no complete checkpoint.

        One rule for every failed check (missing or corrupt marker, missing, resized or
        checksum-failing file, torn or non-finite data: ``CorruptCheckpoint``): warn naming the
        reason and try the previous one. The loader raises those before touching the model, so a
        skipped checkpoint leaves nothing behind. Other refusals (another model, another
        optimizer kind) hold for every checkpoint and stop the run.
        """
        from megatron_rl.errors import CheckpointError
        from megatron_rl.infra import checkpoint_root as ckpt

        candidates = ckpt.resume_candidates(root)  # the same files on every rank: the same order
        skipped = []
        for step in candidates:
            path = ckpt.iter_dir(root, step)
            try:
                return path, backend.load(path)
            except ckpt.CorruptCheckpoint as e:
                skipped.append(f"{path}: {e}")
                log.warning("not resuming from %s: %s; trying the previous complete checkpoint", path, e)
        if skipped:
            raise CheckpointError(f"no checkpoint under {root} passes its checks ({'; '.join(skipped)}); restore "
                                  "one, or move the root away to start from --hf-checkpoint")
        if named:
            raise ConfigError(f"--load {root}: no complete checkpoint there (iter_NNNNNNN dirs with a "
                              "COMPLETE marker); drop --load to start from --hf-checkpoint")
        return None

    def save(self, backend, rollout, step: int) -> None:
        from megatron_rl.infra import checkpoint_root as ckpt

        root = self.cfg.checkpoint.save
        if not root:
            return
        extra = {"rollout_id": step}
        if rollout is not None:
            extra["dataset_state"] = rollout.prompts.state_dict()
        # the driver's dataset state must reach every rank's copy of extra_state
        box = [extra]
        if dist.is_initialized():
            dist.broadcast_object_list(box, src=0)
        path = ckpt.iter_dir(root, step)
        backend.save(path, box[0])
        self.last_checkpoint = (step, path)
        if self.is_driver:
            ckpt.write_latest(root, step)
            ckpt.write_resume_state(root, {"rollout_id": step, "checkpoint": path, "elapsed_s": self.clock.elapsed_s,
                                           "wandb_run_id": self.tracker.wandb_run_id})
            if self.cfg.checkpoint.save_max_to_keep:
                ckpt.prune(root, self.cfg.checkpoint.save_max_to_keep)
                from megatron_rl.rollout.rollout_ckpt import prune as prune_rollout_ckpts

                prune_rollout_ckpts(root)  # a stored rollout lives as long as the checkpoint it follows
        if dist.is_initialized():
            dist.barrier()

    def stop_early(self, step: int) -> int:
        """A planned stop (wall time / SIGTERM): say why, record it for the launcher, return EXIT_WALL_TIME."""
        from megatron_rl.infra.wall_time import EXIT_WALL_TIME, write_run_status

        reason = self.clock.stop_reason() or "stop requested"
        log.warning("stopping early: %s; relaunch the same command to resume", reason)
        self.tracker.close()
        if self.is_driver:
            write_run_status(self.cfg.runtime.output_dir, "stopped_early", reason=reason, rollout_id=step)
        return EXIT_WALL_TIME

    def finish(self, backend, rollout) -> None:
        from megatron_rl.infra.wall_time import write_run_status

        n = self.cfg.rollout.num_rollout
        if backend is not None and self.cfg.checkpoint.save and not self.save_due(n - 1):
            self.save(backend, rollout, n)
        self.tracker.close()
        if self.is_driver:
            write_run_status(self.cfg.runtime.output_dir, "finished", rollout_id=n)
        if self.is_driver:
            from megatron_rl.infra.plot import DEFAULT_KEYS, plot_metrics
            from megatron_rl.infra.tracking import read_jsonl

            out = os.path.join(self.cfg.runtime.output_dir, "curves.png")
            plot_metrics(read_jsonl(self.tracker.jsonl_path), DEFAULT_KEYS, out, title=self.cfg.runtime.output_dir)
            log.info("wrote %s", out)


def print_plan(cfg) -> int:
    """``--dry-run``: every check has passed; show the placement and exit without starting work."""
    from megatron_rl.config.placement import plan_for_config
    from megatron_rl.plan import format_table, validate_plan

    plan = plan_for_config(cfg)
    print(format_table(plan, validate_plan(plan)))
    print(f"dry run: configuration valid; training world {cfg.actor_world_size} rank(s), "
          f"data-parallel {cfg.data_parallel_size}; nothing was started")
    return 0
