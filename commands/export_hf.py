"""`python -m commands.export_hf RUN_DIR OUT`: a trained run as a DeepSeek-V3-family checkpoint.

    python -m commands.export_hf RUN_DIR OUT [--step N] [section.field=value ...]

For a run of moekit's GPT sized by a deepseek_v3 hf.config: its newest good checkpoint (or
step N), saved under any layout, loaded into one process (trainer/inference.py), written to
OUT as model.safetensors in the checkpoint's own names (transformers' DeepseekV3ForCausalLM
loads it) and a config.json (the run's hf.config with num_nextn_predict_layers =
model.mtp_depth): the MTP depths as layers n_layers + k, with DeepSeek's copies of the
embedding and head, the rotary rows interleaved back (models/hf_weights.py). Reading it back
with hf.weights=OUT gives the run's tensors byte for byte.
"""
import argparse
import sys


def _parser():
    p = argparse.ArgumentParser(prog="python -m commands.export_hf", description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("run_dir", help="a train.py run directory (its run.dir)")
    p.add_argument("out", help="directory to write model.safetensors and config.json into")
    p.add_argument("--step", type=int, help="checkpoint step to export (default: the newest good one)")
    p.add_argument("overrides", nargs="*", help="section.field=value on the run's config")
    return p


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    from trainer.config import ConfigError
    try:
        _export(args)
    except (ConfigError, ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


def _export(args) -> None:
    from models.hf_sizes import deepseek_v3_config, read_hf_config
    from models.hf_weights import write_deepseek_v3
    from trainer.inference import load_run
    run = load_run(args.run_dir, args.step, args.overrides)
    cfg = run.cfg
    hf = read_hf_config(cfg.hf.config) if cfg.hf.config else {}
    if hf.get("model_type") != "deepseek_v3":
        raise ValueError(f"{args.run_dir} was not sized by a deepseek_v3 hf.config (hf.config="
                         f"{cfg.hf.config!r}); export_hf writes DeepSeek-V3-family checkpoints only")
    write_deepseek_v3(run.model.state_dict(), cfg.model, deepseek_v3_config(hf, cfg.model, cfg.moe),
                      args.out)
    print(f"wrote {args.out}/model.safetensors and config.json (step {run.step}, "
          f"{cfg.model.mtp_depth} MTP layer(s))")


if __name__ == "__main__":
    sys.exit(main())
