"""``megasparse train``: pretraining on ``deepspeed.initialize`` with a client optimizer.

One optimizer step consumes one global batch: each data-parallel rank runs
``gradient_accumulation_steps`` micro-batches through ``engine.forward/backward/step``
(DeepSpeed reduces gradients and steps the optimizer and scheduler at the boundary). The
logged loss is the mean over the whole global batch (all micro-batches, all ranks).
"""
from __future__ import annotations

import json
import math
import time
from datetime import timedelta
from contextlib import nullcontext
from pathlib import Path

import deepspeed
import deepspeed.comm as dist
import torch
import yaml
from deepspeed.accelerator import get_accelerator
from torch.optim.lr_scheduler import LambdaLR

from megasparse.checkpoint.compat import check_compatible, same_layout
from megasparse.checkpoint.legacy import CODED_MASKS, PADDED
from megasparse.checkpoint.durable import (PendingCheckpoint, RecordingCheckpointEngine, keep_recovery_script_errors,
                                           remove_partials, verify_on_all_ranks)
from megasparse.checkpoint.files import CheckpointMeta, complete_checkpoints, tag_for
from megasparse.checkpoint.weights import init_from_directory
from megasparse.config import Config, config_from_dict
from megasparse.data.corpus import describe_sources, trains_on_embedded_corpus
from megasparse.data.loader import ORDER, evaluation_batches, inputs_and_targets, to_device
from megasparse.data.mixture import Mixture
from megasparse.data.prepare_mixture import missing_sources
from megasparse.data.shards import INDEX_FILE, TokenWindows, open_prepared
from megasparse.data.tokenizer import continuation, load_tokenizer
from megasparse.errors import UserError
from megasparse.faults import at_step_start, poison_gradient, poison_loss
from megasparse.lowrank.layers import SharedFactorisation
from megasparse.model.sampling import Sampling, continue_tokens
from megasparse.lowrank.spectron import Spectron, factor_pairs
from megasparse.model.execution import checkpoint_blocks, compile_blocks
from megasparse.model.factory import density_rounding, layer_factory
from megasparse.model.flops import flops_per_token
from megasparse.model.llama import Llama, num_parameters
from megasparse.model.placement import DTYPES, built_on, partitions_as_built, zero3_partition
from megasparse.optim.partitions import optimizer_fragments
from megasparse.parallel.distributed import gradient_norm, init_distributed, is_main_process, rank0_runs
from megasparse.parallel.groups import ParallelState, create_groups, split_world
from megasparse.parallel.launch_env import discover_launch_env
from megasparse.parallel.mappings import TensorParallel
from megasparse.parallel.watchdog import Heartbeat, stall_timeout
from megasparse.sparse.topology import TopologyUpdater
from megasparse.train.data import ONE_SOURCE, check_data_to_prepare, load_or_prepare, usable_windows
from megasparse.train.checkpoint import (check_resume, finish_save, load_checkpoint, resolve_resume, rng_state,
                                         set_rng_state, start_save)
from megasparse.train.deepspeed_config import deepspeed_config
from megasparse.train.determinism import make_deterministic
from megasparse.train.guard import StepDecision
from megasparse.train.memory import held_bytes, is_projection
from megasparse.train.metrics import MetricsLogger, WandbRun
from megasparse.train.optim import build_optimizer
from megasparse.train.preemption import StopRequests, clear_marker, write_marker
from megasparse.train.restarts import check_restarts
from megasparse.train.schedule import LearningRateSchedule
from megasparse.train.throughput import device_peak_tflops, throughput


def train(cfg: Config, resume: str | None = None) -> "Trainer":
    """Run (or continue, with ``resume``) the training described by ``cfg``; returns the finished trainer."""
    if cfg.training.deterministic:
        make_deterministic()  # before any device work: cuBLAS reads its workspace setting when it starts
    parallel = start_processes(cfg, resume)
    world = dist.get_world_size()
    heartbeat = Heartbeat(dist.get_rank(), world, cfg.parallel.heartbeat_seconds,
                          cfg.parallel.timeout_minutes * 60) if world > 1 and cfg.parallel.heartbeat_seconds > 0 else None
    trainer = None
    try:
        trainer = Trainer(cfg, parallel, resume, heartbeat)
        trainer.run()
    except RuntimeError as exc:  # gloo reports a lost peer as a plain RuntimeError, NCCL as DistBackendError
        silent = heartbeat.diagnosis() if heartbeat else None
        if silent is None:
            raise
        where = f"after step {trainer.step}" if trainer else "while starting"
        raise UserError(f"rank {dist.get_rank()}: a collective failed {where}: {silent} "
                        f"[{str(exc).strip().splitlines()[0][:160]}]") from None
    finally:
        if heartbeat:
            heartbeat.stop()
    return trainer


def start_processes(cfg: Config, resume: str | None = None) -> ParallelState:
    """Find this process's rank, refuse what is wrong before any other process is needed (:func:`preflight`),
    join the process group, create the TP x DP groups."""
    launch = discover_launch_env()
    preflight(cfg, launch.world_size, resume)
    check_restarts(cfg, writes=launch.rank == 0)
    init_distributed(launch, cfg.parallel.timeout_minutes, Path(cfg.training.output_dir) / "nccl_traces")
    return create_groups(cfg.parallel.tensor_parallel, timedelta(minutes=cfg.parallel.timeout_minutes))


def preflight(cfg: Config, world_size: int, resume: str | None = None) -> str | None:
    """Everything that can be refused from the config and the files alone: the config for this number of
    processes (its micro-batch fitted to the data-parallel ranks: :meth:`Config.fit_micro_batch`, whose note
    is returned), its paths (``checkpoint.init_from`` only for a run that will not resume), the layer shapes
    (sparse densities, low-rank ranks), and the dataset if it exists, otherwise the sources to prepare it."""
    data_parallel_size = split_world(world_size, cfg.parallel.tensor_parallel)
    fitted = cfg.fit_micro_batch(data_parallel_size)
    cfg.validate(data_parallel_size)
    resumes = resume is not None and (resume != "auto" or bool(complete_checkpoints(cfg.checkpoint_dir)))
    cfg.check_paths(key for key, _ in cfg.keys() if not (resumes and key == "checkpoint.init_from"))
    layer_factory(cfg)
    if world_size > 1 and cfg.parallel.heartbeat_seconds > 0:
        stall_timeout(cfg.parallel.timeout_minutes * 60, cfg.parallel.heartbeat_seconds)
    if cfg.logging.wandb:
        try:
            import wandb  # noqa: F401
        except ImportError as exc:
            raise UserError(f"logging.wandb: cannot import wandb ({exc}); install it with pip install "
                            "'megasparse[wandb]' or set logging.wandb=false") from None
    if (Path(cfg.data.path) / INDEX_FILE).exists() and not (cfg.data.sources and missing_sources(cfg.data)):
        prepared = open_prepared(Path(cfg.data.path))
        windows = usable_windows(cfg, prepared)
        if cfg.data.sources and not resumes:  # (a resumed run's reads so far are counted once it has loaded them)
            t = cfg.training
            Mixture(cfg.data.sources).check_caps([len(w) for w in windows.train.values()], 0, t.steps,
                                                 t.global_batch_size)
        check_resume(cfg, resume, prepared.vocab_size, prepared.tokenizer_sha256)
    else:  # everything the data to prepare could be refused for, before it is prepared
        describe_sources(cfg.data)  # the files to prepare it from exist
        vocab_size, tokenizer_sha256 = check_data_to_prepare(cfg)
        check_resume(cfg, resume, vocab_size, tokenizer_sha256)
    return fitted


def wandb_run(cfg: Config) -> WandbRun | None:
    """The run as Weights & Biases shows it (``logging.wandb``): named after its output directory by default."""
    log = cfg.logging
    if not log.wandb:
        return None
    return WandbRun(log.wandb_project, log.wandb_entity, log.wandb_name or Path(cfg.training.output_dir).resolve().name,
                    cfg.to_dict())


class Trainer:
    def __init__(self, cfg: Config, parallel: ParallelState, resume: str | None,
                 heartbeat: Heartbeat | None = None) -> None:
        self.cfg, self.parallel, self.heartbeat = cfg, parallel, heartbeat
        self.dp_rank, self.dp_size = parallel.data_parallel_rank, parallel.data_parallel_size
        self.dp_group = parallel.data_parallel_group
        t = cfg.training
        self.data = load_or_prepare(cfg, heartbeat, _log)
        self.windows = usable_windows(cfg, self.data)
        self.epoch_sequences = self.windows.epoch_sequences  # an epoch: every training window once
        self.tp = tp = TensorParallel(parallel.tensor_parallel_group, parallel.tensor_parallel_size,
                                      parallel.tensor_parallel_rank)
        self.resume_from = self._checked_resume(resume)  # before the expensive part: fail fast

        self.ds_config = deepspeed_config(cfg, self.dp_size)
        torch.manual_seed(t.seed)
        factorise = SharedFactorisation()
        # onto the device in the training precision as it is built: the host never holds the whole fp32 model,
        # and at ZeRO-3 the device holds its partitions and one module whole
        as_built = cfg.parallel.zero_stage == 3 and partitions_as_built()
        partition = zero3_partition(self.ds_config, parallel) if as_built else None
        layers = layer_factory(cfg, tp, factorise)
        with built_on(get_accelerator().current_device_name(), DTYPES[t.precision], partition):
            model = Llama(cfg.model, self.data.vocab_size, layers)
        factorise.share(model)
        if cfg.checkpoint.init_from and not self.resume_from:
            init_from_directory(model, Path(cfg.checkpoint.init_from), cfg, self.data.vocab_size,
                                self.data.tokenizer_sha256, tp)
            _log(f"initialised the model from {cfg.checkpoint.init_from}")
        checkpoint_blocks(model, t.activation_checkpointing)
        if t.compile:
            compile_blocks(model)
        self.num_parameters = num_parameters(model)
        self.flops_per_token = flops_per_token(cfg, self.data.vocab_size)
        self.peak_tflops = device_peak_tflops(t.peak_tflops)
        schedule = LearningRateSchedule(cfg.optimizer, t.steps)
        self.optimizer = build_optimizer(cfg, model)
        poison_gradient(model, lambda: self.step + 1)  # before the decision's hooks, which must see it
        # before the scheduler wraps the optimizer's step
        self.decision = StepDecision(model, self.optimizer, get_accelerator().current_device_name())
        # The schedule goes in as a plain function, which LambdaLR leaves out of its state (a callable object's
        # attributes it would save, and a resume would restore the checkpoint's schedule over the config's): a run
        # resumed with other training.steps, optimizer.* or spectron rates follows its own config from its step on
        # (_load), as a cooldown branched from a constant-rate trunk must.
        self.engine, *_ = deepspeed.initialize(
            model=model, optimizer=self.optimizer, mpu=parallel,
            lr_scheduler=lambda optimizer: LambdaLR(optimizer, lambda step: schedule(step)), config=self.ds_config,
            dist_init_required=False,
        )
        self.device = self.engine.device
        self.configured_rates = tuple(self.engine.lr_scheduler.base_lrs)  # each group's peak, from this config
        self.decision.reports_to(self.engine.optimizer)
        if self.dp_size == 1 and cfg.parallel.zero_stage == 0:
            # One data-parallel rank has no gradients to reduce, but DeepSpeed's ZeRO-0 path would still copy
            # every gradient into flat buckets, all-reduce them over that one rank and copy them back.
            self.engine.enable_backward_allreduce = False
        self.engine.checkpoint_engine = RecordingCheckpointEngine(self.engine.checkpoint_engine)
        keep_recovery_script_errors(self.engine, self.engine.checkpoint_engine)
        self.skipped_steps = self.consecutive_skips = 0
        self.saving: PendingCheckpoint | None = None  # the checkpoint in flight (its files written in the background)
        self.save_held_s = 0.0
        self.memory_logged = False

        def fragments(param: torch.nn.Parameter):
            return optimizer_fragments(self.engine, self.optimizer, param)

        partitioned = cfg.parallel.zero_stage > 0
        self.topology = TopologyUpdater(self.engine.module, cfg.sparse, t.steps, t.seed, self.optimizer, fragments,
                                        self.dp_group, partitioned) if cfg.model.layer in ("sparse", "hybrid") \
            else None
        if isinstance(self.optimizer, Spectron):
            self.optimizer.attach(factor_pairs(self.engine.module), fragments, self.dp_group,
                                  partitioned=partitioned)
        # DeepSpeed reports the gradient norm from its ZeRO/mixed-precision optimizers only.
        self.measure_grad_norm = not hasattr(self.engine.optimizer, "_global_grad_norm")
        self.loader = self.windows.batches(cfg, self.dp_rank, self.dp_size)
        self.step = self._load(self.resume_from) if self.resume_from else 0
        if self.loader.mixture:
            self.loader.mixture.check_caps([len(w) for w in self.windows.train.values()], self.step, t.steps,
                                           t.global_batch_size)
        self.saved_step = self.step if self.resume_from else None
        self.metrics = MetricsLogger(Path(t.output_dir), is_main_process(), self.step, t.steps,
                                     cfg.logging.progress_bar, cfg.logging.tensorboard, wandb_run(cfg))

    def _checked_resume(self, resume: str | None) -> Path | None:
        """The checkpoint to resume from, checked against this run; None to start fresh."""
        directory = self.cfg.checkpoint_dir
        tag_dir = resolve_resume(resume, directory, verify_on_all_ranks, lambda message: _log(f"warning: {message}"))
        if tag_dir is None:  # (checkpoints there without --resume were refused by preflight)
            return None
        meta = CheckpointMeta.read(tag_dir)
        check_compatible(meta, self.cfg, self.data.vocab_size, self.data.tokenizer_sha256, tag_dir)
        return tag_dir

    def _load(self, tag_dir: Path) -> int:
        meta = CheckpointMeta.read(tag_dir)
        state = load_checkpoint(self.engine, self.optimizer, tag_dir, self.cfg, self.tp, self.dp_size)
        # This config's peak rates and schedule from the checkpoint's step on (LambdaLR's and the optimizer's loaded
        # state carry the checkpoint's base rates): the next step's rate, as a straight run of this config has it
        scheduler = self.engine.lr_scheduler
        scheduler.base_lrs = list(self.configured_rates)
        for group, base, rate in zip(scheduler.optimizer.param_groups, scheduler.base_lrs, scheduler.lr_lambdas):
            group["initial_lr"], group["lr"] = base, base * rate(scheduler.last_epoch)
        self.skipped_steps = state.get("skipped_steps", 0)  # (checkpoints before it was saved: counted from here)
        dropped = self.loader.load_state_dict(state["loader"])
        self.loader.steps = meta.step  # the schedule's clock (a checkpoint's loader state may predate it)
        if dropped:
            _log(f"warning: {tag_dir} read from sources this run's data.sources no longer has: {', '.join(dropped)}")
        mixture = self.loader.mixture
        if mixture and mixture.segment and mixture.segment.weights != mixture.weights_at(meta.step + 1):
            change = ", ".join(f"{name} {old:.3g} -> {new:.3g}" for name, old, new in
                               zip(mixture.names, mixture.segment.weights, mixture.weights_at(meta.step + 1)))
            _log(f"data: the mixture's weights differ from the checkpoint's ({change}): they apply from step "
                 f"{meta.step + 1} on, and every source reads on from where it stopped")
        epoch, position = divmod(self.loader.consumed_samples, self.epoch_sequences)
        if state["loader"].get("order") != ORDER and position:
            _log(f"warning: {tag_dir} was written when the loader ordered the windows otherwise: the rest of epoch "
                 f"{epoch} reads them in today's order, so some of its windows come again and others not at all "
                 "(the next epochs are whole)")
        other = set_rng_state(state["rng"])
        if other:
            _log(f"warning: {tag_dir} was written on {other}: its {other} random state does not apply to "
                 f"{get_accelerator().device_name()} and is left out (the run continues, not bit-identical)")
        resharded = "" if same_layout(meta, self.cfg, self.dp_size) else (
            f" (resharded from {meta.tensor_parallel_size} tensor-parallel x {meta.data_parallel_size} data-parallel "
            f"ranks, ZeRO-{config_from_dict(meta.config).parallel.zero_stage}, {meta.format} format)")
        _log(f"resumed from {tag_dir} at step {meta.step}{resharded}")
        return meta.step

    def run(self) -> None:
        """Train to ``training.steps``, or until a stop signal (see preemption.py) ends the run early."""
        stop = StopRequests()
        stop.install()
        try:
            self._run(stop)
        finally:
            stop.uninstall()

    def _run(self, stop: StopRequests) -> None:
        t, cfg = self.cfg.training, self.cfg
        if is_main_process():
            out = Path(t.output_dir)
            out.mkdir(parents=True, exist_ok=True)
            clear_marker(out)
            (out / "config.yaml").write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
            (out / "deepspeed.json").write_text(json.dumps(self.ds_config, indent=2) + "\n")
            _log(f"model: {self.num_parameters:,} parameters per tensor-parallel rank, vocabulary "
                 f"{self.data.vocab_size}; {self.parallel.tensor_parallel_size} tensor-parallel x {self.dp_size} "
                 f"data-parallel rank(s), ZeRO-{cfg.parallel.zero_stage}, {t.precision}, "
                 f"{self.loader.accumulation_steps} micro-batch(es) of {t.micro_batch_size} per step")
            if cfg.model.layer in ("sparse", "hybrid") and cfg.sparse.active_multiple > 1:
                before, after = density_rounding(cfg)
                _log(f"sparse: active counts rounded to multiples of {cfg.sparse.active_multiple} "
                     f"(sparse.active_multiple): overall density {before:.6f} -> {after:.6f}")
            if self.loader.mixture:
                weights = self.loader.mixture.weights_at(self.step + 1)
                _log(f"data: a mixture of sequences of {cfg.data.seq_len} tokens, " + ", ".join(
                    f"{name} ({len(self.windows.train[name]):,} sequences, weight {w:.3g})"
                    for name, w in zip(self.loader.mixture.names, weights)) + f"; {t.steps:,} steps of "
                    f"{t.global_batch_size}")
            else:
                epochs = t.steps * t.global_batch_size / self.epoch_sequences
                embedded = trains_on_embedded_corpus(cfg.data)
                source = " (the embedded corpus, a smoke test's data)" if embedded else ""
                _log(f"{'warning: ' if embedded and epochs > 1 else ''}data: {self.epoch_sequences:,} training "
                     f"sequences of {cfg.data.seq_len} tokens{source}; {t.steps:,} steps of {t.global_batch_size} "
                     f"read {epochs:,.2f} epoch(s)")
        rank0_runs(self._prepare_checkpoint_dir, "preparing the checkpoint directory")
        tokens_per_step = t.global_batch_size * cfg.data.seq_len
        window_loss, window_start = torch.zeros((), device=self.device), time.perf_counter()
        window_steps = window_updates = 0  # the window's steps, and those of them not skipped
        while self.step < t.steps:
            log_now = (self.step + 1) % cfg.logging.log_interval == 0 or self.step + 1 == t.steps
            lr = self.engine.get_lr()[0]  # the rate this step uses (the scheduler moves on at its end)
            if self.heartbeat:
                self.heartbeat.progress()
            at_step_start(self.step + 1)
            skips_before = self._skip_counters()
            topology = self.topology.around_step(self.step + 1, self.loader.accumulation_steps) if self.topology \
                else nullcontext()
            with topology:
                loss, grad_norm, stop_agreed = self._train_step(stop, measure_norm=log_now and self.measure_grad_norm)
            self.step += 1
            skipped = self._skip_counters() != skips_before  # the same on every rank
            if skipped:
                self._skipped_step()
            else:
                self.consecutive_skips = 0
            # a skipped step skips its topology update too: its gradients were not finite (RigL would rank them)
            if self.topology and self.topology.due(self.step) and not skipped:
                self.metrics.log("topology", self.step, **self.topology.update(self.step))
            if not self.memory_logged and not skipped:  # after the first step: the optimizer state exists
                self.metrics.log("memory", self.step, **self._held_memory())
                self.memory_logged = True
            window_steps += 1
            if not skipped:  # a skipped step's loss (not finite on some rank) stays out of the window's mean
                window_loss += loss
                window_updates += 1
            if log_now:
                dist.all_reduce(window_loss, group=self.dp_group)
                get_accelerator().synchronize()  # the window's work done on the device before the clock is read
                elapsed = time.perf_counter() - window_start
                grad_norm = grad_norm if grad_norm is not None else self.engine.get_global_grad_norm()
                values = {
                    "loss": window_loss.item() / (window_updates * self.dp_size) if window_updates else float("nan"),
                    "lr": lr,
                    **({"grad_norm": float(grad_norm)} if grad_norm is not None else {}),
                    "tokens": self.step * tokens_per_step,
                    "epoch": self._epochs(),
                    "tokens_per_s": window_steps * tokens_per_step / elapsed,
                    **throughput(window_steps * tokens_per_step / elapsed, dist.get_world_size(),
                                 self.flops_per_token.training, self.peak_tflops),
                    "step_time_s": elapsed / window_steps,
                    "memory_gb": get_accelerator().max_memory_allocated() / 2**30,
                    "skipped_steps": self.skipped_steps,
                    **self._optimizer_statistics(),
                    **self._realised_mix(),
                }
                self.metrics.log("train", self.step, **values)
                window_loss.zero_()
                window_steps = window_updates = 0
                window_start = time.perf_counter()
            self.metrics.advance()
            paused = time.perf_counter()  # what follows is left out of the window's time, not its steps
            if t.eval_samples > 0 and self._due(t.eval_interval, at_end=True):
                self._evaluate()
            if self._due(cfg.logging.sample_interval, at_end=False):
                self._sample()
            if self.saving is not None and self.decision.all_written:
                self._finish_save()
            if self._due(cfg.checkpoint.interval, cfg.checkpoint.save_final) or self.step in cfg.checkpoint.at_steps:
                self._save()
            window_start += time.perf_counter() - paused
            if self.step < t.steps and stop_agreed:
                self._stop_early(stop)
                break
        self._finish_save()
        self.metrics.close()

    def _stop_early(self, stop: StopRequests) -> None:
        """Save (unless this step just did), wait until it is written, and leave the marker a job script
        requeues on."""
        if self.saved_step != self.step:
            self._save()
        self._finish_save()
        tag_dir = self.cfg.checkpoint_dir / tag_for(self.step)
        name = stop.received.name if stop.received else "another rank's stop signal"
        if is_main_process():
            write_marker(Path(self.cfg.training.output_dir), self.step, name, tag_dir)
        _log(f"stopped by {name} after step {self.step}; saved {tag_dir}; continue with --resume auto")

    def _prepare_checkpoint_dir(self) -> None:
        """Create the checkpoint directory (fail now, not at the first save) and drop interrupted saves."""
        directory = self.cfg.checkpoint_dir
        try:
            directory.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise UserError(f"cannot write checkpoints to {directory}: {exc.strerror or exc}") from None
        remove_partials(directory)

    def _skip_counters(self) -> tuple[int, int]:
        """Steps skipped so far by the step decision and by DeepSpeed's own overflow check."""
        return self.decision.skipped, self.engine.skipped_steps

    def _skipped_step(self) -> None:
        """Log a step whose gradients were not finite (skipped on every rank); stop after
        ``training.max_skipped_steps`` in a row."""
        self.skipped_steps += 1
        self.consecutive_skips += 1
        self.metrics.log("skipped", self.step, consecutive=self.consecutive_skips, total=self.skipped_steps)
        _log(f"warning: step {self.step} skipped: non-finite loss or gradient on some rank")
        limit = self.cfg.training.max_skipped_steps
        if limit and self.consecutive_skips >= limit:
            self._finish_save()  # a checkpoint in flight is whole: published before the run stops
            complete = complete_checkpoints(self.cfg.checkpoint_dir)
            raise UserError(f"stopped at step {self.step}: {self.consecutive_skips} consecutive steps had a non-finite "
                            f"loss or gradient (training.max_skipped_steps={limit}); the last good checkpoint is "
                            f"{complete[-1] if complete else 'none'}")

    def _due(self, interval: int, at_end: bool) -> bool:
        return (interval > 0 and self.step % interval == 0) or (at_end and self.step == self.cfg.training.steps)

    def _train_step(self, stop: StopRequests, measure_norm: bool) -> tuple[torch.Tensor, float | None, bool]:
        """One optimizer step; returns this rank's mean micro-batch loss (and the gradient norm if
        it had to be measured here), and whether all ranks agreed to stop after it."""
        micro_batches = to_device(self.loader.next_tokens(), self.device)
        total, grad_norm, stop_agreed = torch.zeros((), device=self.device), None, False
        for i, tokens in enumerate(micro_batches):
            loss = poison_loss(self.engine(*inputs_and_targets(tokens)), self.step + 1)
            self.engine.backward(loss)
            if i == len(micro_batches) - 1:  # the boundary: gradients are reduced, the optimizer steps next
                stop_agreed = self.decision.decide(stop.received is not None,
                                                   writing=self.saving is not None and self.saving.writing())
                if measure_norm:
                    grad_norm = gradient_norm(self.engine.module.parameters(), self.parallel)
            self.engine.step()
            total += loss.detach().float()
        return total / len(micro_batches), grad_norm, stop_agreed

    @torch.no_grad()
    def _evaluate(self) -> None:
        """The validation loss of each source over its first ``training.eval_samples`` windows; a mixture's is
        their mean weighted by the weights of this step."""
        losses = {name: self._validation_loss(windows) for name, windows in self.windows.validation.items()}
        if self.loader.mixture:
            weights = self.loader.mixture.weights_at(self.step)
            val_loss = sum(w * losses[name] for name, w in zip(self.loader.mixture.names, weights))
            by_source = {f"val_loss/{name}": loss for name, loss in losses.items()}
        else:
            val_loss, by_source = losses[ONE_SOURCE], {}
        self.metrics.log("eval", self.step, val_loss=val_loss, val_ppl=math.exp(min(val_loss, 50.0)), **by_source)

    def _validation_loss(self, windows: TokenWindows) -> float:
        cfg = self.cfg
        batches = evaluation_batches(windows, cfg.training.eval_samples, cfg.training.micro_batch_size,
                                     self.dp_rank, self.dp_size)
        self.engine.eval()
        totals = torch.zeros(2, device=self.device, dtype=torch.float64)  # loss sum, sequences
        for inputs, targets in batches:
            loss = self.engine(inputs.to(self.device), targets.to(self.device))
            totals += torch.stack([loss.double() * len(inputs), totals.new_tensor(len(inputs))])
        self.engine.train()
        dist.all_reduce(totals, group=self.dp_group)
        return (totals[0] / totals[1]).item()

    @torch.no_grad()
    def _sample(self) -> None:
        """``logging.sample_tokens`` tokens after ``logging.sample_prompt``, drawn on every rank with the same seed
        (rank 0's token taken by all at each step: the ranks run the model together), printed and logged by
        rank 0."""
        cfg = self.cfg.logging
        pieces = load_tokenizer(self.data.tokenizer_path)
        room = self.cfg.data.seq_len - cfg.sample_tokens  # the positions the model was trained on
        prompt = [pieces.eos_id(), *pieces.encode(cfg.sample_prompt)][-room:]
        generator = torch.Generator(device=self.device).manual_seed(self.cfg.training.seed + self.step)

        def agree(token: torch.Tensor) -> torch.Tensor:
            dist.broadcast(token, src=0)
            return token

        self.engine.eval()
        tokens = continue_tokens(self.engine, prompt, cfg.sample_tokens, Sampling(), generator, pieces.eos_id(), agree)
        self.engine.train()
        self.metrics.text("sample", self.step, cfg.sample_prompt + continuation(pieces, prompt, tokens))

    def _passes(self) -> dict[str, float]:
        """A mixture's passes over each source's windows so far."""
        mixture = self.loader.mixture
        return {name: drawn / len(self.windows.train[name]) for name, drawn in zip(mixture.names, mixture.drawn)}

    def _epochs(self) -> float:
        """Passes over the training windows so far; of a mixture, over the source read most often."""
        if self.loader.mixture:
            return max(self._passes().values())
        return self.loader.consumed_samples / self.epoch_sequences

    def _realised_mix(self) -> dict[str, float]:
        """A mixture's share of each source over the run so far, and the passes over each source's windows."""
        if not self.loader.mixture:
            return {}
        return {**{f"mix/{name}": share for name, share in self.loader.mixture.shares().items()},
                **{f"epochs/{name}": passes for name, passes in self._passes().items()}}

    def _mixture_record(self) -> dict[str, dict[str, float]]:
        mixture = self.loader.mixture
        if not mixture:
            return {}
        return {name: {"sequences": drawn, "weight": weight}
                for name, drawn, weight in zip(mixture.names, mixture.drawn, mixture.weights_at(self.step))}

    def _optimizer_statistics(self) -> dict[str, float]:
        """Spectron: the largest and mean sigma_A + sigma_B over the factor pairs at the last step."""
        norms = getattr(self.optimizer, "spectral_norms", None)
        if not norms:
            return {}
        sums = torch.stack(list(norms.values()))
        return {"spectral_norm_max": sums.max().item(), "spectral_norm_mean": sums.mean().item()}

    def _held_memory(self) -> dict[str, int]:
        """What rank 0 holds between steps, by kind (megasparse.train.memory), whole model and projections."""
        model = held_bytes(self.engine, self.optimizer)
        projections = held_bytes(self.engine, self.optimizer, is_projection)
        return {**{f"{kind}_bytes": value for kind, value in model.items()},
                **{f"projections_{kind}_bytes": value for kind, value in projections.items()}}

    def _save(self) -> None:
        """Start a checkpoint of this step, after publishing the one in flight (at most one is); with
        ``checkpoint.async_save`` its files are written in the background (:func:`_finish_save` publishes it)."""
        self._finish_save()
        t = self.cfg.training
        started = time.perf_counter()
        self.saved_step = self.step
        meta = CheckpointMeta(
            step=self.step, consumed_samples=self.loader.consumed_samples,
            tokens=self.step * t.global_batch_size * self.cfg.data.seq_len, config=self.cfg.to_dict(),
            vocab_size=self.data.vocab_size, tokenizer_sha256=self.data.tokenizer_sha256,
            world_size=dist.get_world_size(), data_parallel_size=self.dp_size,
            tensor_parallel_size=self.parallel.tensor_parallel_size, sparse_storage=CODED_MASKS, mlp_storage=PADDED,
            mixture=self._mixture_record(),
        )
        self.saving = start_save(self.engine, self.cfg, meta, {"loader": self.loader.state_dict(), "rng": rng_state(),
                                                              "skipped_steps": self.skipped_steps},
                                 self.data.tokenizer_path, background=self.cfg.checkpoint.async_save)
        self.save_held_s = time.perf_counter() - started
        if self.saving.write is None:
            self._finish_save()

    def _finish_save(self) -> None:
        """Publish the checkpoint in flight, if any (waiting for its files), and log what it took: the time the
        training loop was held (staging, waiting, publishing) and the time its files took to write."""
        if self.saving is None:
            return
        started = time.perf_counter()
        saving, self.saving = self.saving, None
        finish_save(self.engine, self.cfg, saving)
        held = self.save_held_s + time.perf_counter() - started
        self.metrics.log("checkpoint", self.step, saved_step=int(saving.tag.removeprefix("step_")), held_s=held,
                         bytes=saving.bytes, write_s=saving.write.seconds if saving.write is not None else held)


def _log(message: str) -> None:
    if dist.get_rank() == 0:
        print(f"[megasparse] {message}", flush=True)
