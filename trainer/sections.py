"""The trainer's own config sections (model/moe come from models.config, parallel from
parallel.plan). Every field has a one-line help in its metadata (shown by --help) and a
default that trains on a laptop CPU in a few minutes.
"""
from dataclasses import dataclass

from models.config import help_field


_f = help_field


@dataclass
class RunConfig:
    dir: str = _f("auto", "run directory: checkpoints/, metrics.jsonl, tb/ (TensorBoard), config.toml; "
                          "auto = a new runs/<run.name>-NNN for every run (printed at start)")
    name: str = _f("", "names the auto run directories runs/<name>-NNN; empty = the --config file's "
                       "name (configs/layout_tp2.toml -> layout_tp2), or 'default' without --config")
    device: str = _f("auto", "auto (cuda when available, else cpu) | cpu | cuda")
    overwrite: bool = _f(False, "start over in a run.dir that already holds a run (deletes its checkpoints and logs)")
    dist_timeout_s: int = _f(300, "process-group timeout in seconds (a hung collective fails after this)")
    hang_timeout_s: float = _f(60.0, "under torchrun: a rank whose heartbeat (a side thread, independent of the training work) stops for this long is named and every rank stops (exit 4; trainer/heartbeat.py); 0 = off")


@dataclass
class TrainConfig:
    steps: int = _f(300, "optimizer steps to train for (the total, also when resuming)")
    seed: int = _f(0, "seed for weights, data order, dropout and router jitter")
    batch_size: int = _f(16, "GLOBAL batch in sequences per optimizer step (the same for every parallel layout)")
    micro_batch_size: int = _f(0, "sequences per forward pass per data-parallel rank (gradient accumulation); 0 = whole per-rank batch")
    lr: float = _f(2e-3, "peak learning rate (AdamW)")
    min_lr_ratio: float = _f(0.1, "final learning rate of the cosine decay, as a fraction of train.lr")
    warmup_steps: int = _f(20, "linear warmup steps from 0 to train.lr")
    optimizer: str = _f("adamw", "adamw | adafactor (factored second moments; zero 0 or 3, not 1/2) | muon (torch.optim.Muon's update on the hidden matrices -- Linear weights, and each expert's matrices of the expert banks -- and AdamW on the rest: embeddings, the output head, norms, biases, routers, gates; every layout -- dp, cp, pp, ep, tp of every tp_mode, etp, ZeRO-1/2/3 with offload and hpZ, composed: a matrix held in pieces is orthogonalised whole by one owner rank, parallel/muon.py; the parameter server and 2bw are refused)")
    muon_momentum: float = _f(0.95, "muon: momentum of the matrices' buffer (torch.optim.Muon's default)")
    muon_nesterov: bool = _f(True, "muon: Nesterov momentum")
    muon_ns_steps: int = _f(5, "muon: Newton-Schulz iterations (coefficients 3.4445, -4.775, 2.0315, torch.optim.Muon's)")
    muon_ns_dtype: str = _f("auto", "muon: Newton-Schulz precision, bf16 (torch.optim.Muon's) | fp32 | auto (bf16 on CUDA, fp32 on CPU: without bf16 matrix units bf16 matmuls were ~50x slower than fp32 on this machine)")
    muon_adjust_lr: str = _f("match_rms_adamw", "muon: update scale, match_rms_adamw (lr x 0.2 sqrt(max(rows, cols)): AdamW's lr and weight decay carry over, Moonlight) | original (lr x sqrt(max(1, rows/cols)))")
    adafactor_relative_step: bool = _f(True, "adafactor: step = max(1e-3, RMS(param)) x min(lr, 1/sqrt(t)) (the paper's relative step, capped by the scheduled lr); false: step = the scheduled lr itself")
    weight_decay: float = _f(0.1, "weight decay on matrices (not on norms, biases, router)")
    beta1: float = _f(0.9, "AdamW beta1")
    beta2: float = _f(0.95, "AdamW beta2")
    eps: float = _f(1e-8, "AdamW epsilon")
    optimizer_impl: str = _f("auto", "adamw: auto (torch's fused kernel when every parameter is on CUDA, else torch's default) | fused | foreach | for_loop; adafactor and muon take auto")
    grad_clip: float = _f(1.0, "clip the global gradient norm to this value; 0 = no clipping")
    eval_every: int = _f(50, "evaluate the validation loss every N steps (and at the end); 0 = never")
    eval_batches: int = _f(4, "validation batches (of train.batch_size sequences) per evaluation")
    resume: bool = _f(False, "continue from the latest complete checkpoint in run.dir; with run.dir=auto, "
                             "in the newest runs/<run.name>-NNN that has one (none: starts from step 0 and says so)")
    max_skipped_steps: int = _f(5, "stop (exit 3, naming the step) after this many consecutive steps skipped for a non-finite loss or gradient norm (fp16 overflow skips do not count); 0 = never stop")
    step_checks: str = _f("auto", "where the step's non-finite guard is decided: host (every step reads the loss and gradient norm on the host, which waits for the device) | device (the skip is applied on the device through fused AdamW's found_inf; loss, aux, gradient norm and skips are read once per log.every steps and at evaluations, checkpoints, a SIGTERM (agreed between the hosts every step) and the end, so the host runs ahead; a divergence stop comes at that read; needs train.optimizer=adamw with optimizer_impl auto or fused, no fp16, pp 1, no parameter server, no offload) | auto (device on CUDA where those hold, else host)")
    loss_scale_init: float = _f(65536.0, "parallel.precision=fp16 only: initial loss scale; halved (and the step skipped) on a gradient overflow, doubled after 1000 clean steps")


@dataclass
class DataConfig:
    source: str = _f("stdlib", "'stdlib' (the embedded Python stdlib corpus), a folder of text files, a saved HF dataset, or a prepared dir")
    tokenizer: str = _f("byte", "byte (UTF-8 bytes, NUL separates documents, vocab 256) | bpe (trained locally, cached)")
    vocab_size: int = _f(4096, "BPE vocabulary size (data.tokenizer='bpe' only)")
    seq_len: int = _f(128, "tokens per training sequence (<= model.max_seq_len)")
    val_fraction: float = _f(0.05, "fraction of documents held out for validation")
    max_bytes: int = _f(0, "use only the first N bytes of text of the source; 0 = all")
    text_field: str = _f("text", "column holding the text in a Hugging Face dataset")
    cache_dir: str = _f(".cache/data", "where prepared token files and tokenizers are cached")
    noise_density: float = _f(0.15, "span corruption: fraction of tokens masked (model.arch='switch')")
    mean_span_length: float = _f(3.0, "span corruption: mean masked span length (model.arch='switch')")


@dataclass
class LogConfig:
    every: int = _f(10, "print a log line every N steps (metrics.jsonl gets every step)")
    progress: str = _f("auto", "auto (bar on a terminal, plain lines otherwise) | bar | plain | none")
    tensorboard: bool = _f(True, "write TensorBoard events to run.dir/tb")
    moe_stats_every: int = _f(10, "write per-layer expert-load histograms and routing stats every N steps; 0 = never")
    profile_every: int = _f(0, "write an expert-load profile (run.dir/profile/step_N: load.json, load.png, TensorBoard) every N steps; 0 = never")
    profile_batches: int = _f(2, "held-out batches (of train.batch_size sequences) per load profile")
    peak_mem: bool = _f(True, "measure this rank's peak tensor memory during the second step (the first with optimizer state) and every peak_mem_every-th step (metrics peak_mem_bytes; CUDA: max_memory_allocated, with max_memory_reserved as peak_mem_reserved_bytes; CPU: a live-tensor counter, see trainer/memory.py); false = never")
    peak_mem_every: int = _f(0, "with log.peak_mem, also measure every N-th step; 0 = auto: every step on CUDA (the allocator's own counters: a synchronize before and after; every log.every-th under train.step_checks=device, whose host runs ahead), every 50th on CPU (the live-tensor counter hooks every op: it slows the step it measures, see trainer/memory.py)")
    peak_tflops: float = _f(0.0, "peak dense TFLOP/s of one device, the denominator of metrics mfu; 0 = the data-sheet bf16 peak of a known GPU (A100, H100, H200, B200, MI300X), none elsewhere (no mfu on a CPU)")
    plan_check: str = _f("auto", "after warm-up, print the layout planner's prediction for this run's layout beside the measured peak memory and step time (rank 0; the planner runs in a subprocess beside the first steps; trainer/plan_check.py): on | off | auto (on for GPUs with a planner preset: A100, H100, H200, B200, MI300X; a CPU has no step-time model)")
    comm_bytes: bool = _f(True, "count the bytes each rank hands to collectives per step, by kind (metrics comm_bytes, TensorBoard comm_bytes/*); false removes its per-op dispatch hook")


@dataclass
class CheckpointConfig:
    every: int = _f(100, "save a checkpoint every N steps (and at the end); 0 = only at the end")
    keep: int = _f(2, "complete checkpoints to keep (older ones are deleted after a newer one is complete)")
    at_end: bool = _f(True, "save a checkpoint after the last step")
    async_save: bool = _f(False, "write checkpoints in the background (torch.distributed.checkpoint's async_save: the state is copied to host memory, training goes on while it is written; at most one in flight, waited for before the next save, at the end and on SIGTERM; a checkpoint becomes the latest only once written); also spelled checkpoint.async")
    init_from: str = _f("", "a fresh run starts from the model weights of this run dir or checkpoint dir (any layout; optimizer, schedule and data start anew; a resume loads its own checkpoint instead); '' = initialise")


CHOICES = {
    ("run", "device"): ("auto", "cpu", "cuda"),
    ("data", "tokenizer"): ("byte", "bpe"),
    ("train", "optimizer"): ("adamw", "adafactor", "muon"),
    ("train", "optimizer_impl"): ("auto", "fused", "foreach", "for_loop"),
    ("train", "step_checks"): ("auto", "host", "device"),
    ("train", "muon_adjust_lr"): ("match_rms_adamw", "original"),
    ("train", "muon_ns_dtype"): ("auto", "bf16", "fp32"),
    ("log", "progress"): ("auto", "bar", "plain", "none"),
}
