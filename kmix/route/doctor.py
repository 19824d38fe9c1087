"""`python -m kmix doctor`: versions, devices, half-precision hardware and the measured route."""

import argparse
import os

import kmix
from kmix._output import progress
from kmix.policy import Policy
from kmix.route.facts import capability, gather_facts, tensor_cores, yes_no
from kmix.route.onednn import compare as compare_onednn
from kmix.route.recommendation import recommend
from kmix.route.trials import label


def tf32_line(facts):
    """The report's line about TF32 from `gather_facts()`: only meaningful with a GPU of compute capability 8.0+.

        >>> tf32_line({"gpus": [], "tf32": True})
        'not applicable (no GPU; TF32 is a tensor-core mode of compute capability 8.0+)'
    """
    ccs = [gpu["compute_capability"] for gpu in facts["gpus"]]
    if not ccs:
        return "not applicable (no GPU; TF32 is a tensor-core mode of compute capability 8.0+)"
    capable = [i for i, cc in enumerate(ccs) if cc is not None and tensor_cores(cc)["bfloat16"]]
    if not capable:
        return "not applicable (no GPU of compute capability 8.0+, which TF32 needs)"
    which = "every GPU" if len(capable) == len(ccs) else "GPU " + ", ".join(str(i) for i in capable)
    if facts["tf32"]:
        return f"enabled on {which} (float32 matmuls and convolutions run on tensor cores)"
    return (f"disabled (float32 matmuls in full float32 on {which}; "
            "tf.config.experimental.enable_tensor_float_32_execution(True) turns it on)")


def why_no_gpu(facts):
    """Why a CUDA build of TensorFlow sees no GPU, as far as `gather_facts()` tells; None otherwise."""
    if facts["gpus"] or not facts["built_with_cuda"]:
        return None
    visible = facts.get("cuda_visible_devices")
    if visible is not None and visible.strip() in ("", "-1", "none", "NoDevFiles"):
        return (f"TensorFlow is a CUDA build but sees no GPU: CUDA_VISIBLE_DEVICES is set to "
                f"{visible!r}, which hides every GPU. Unset it, or list the GPUs (e.g. 0).")
    if facts.get("nvidia_driver") is None:
        return ("TensorFlow is a CUDA build but sees no GPU: no NVIDIA driver is loaded (/proc/driver/nvidia/version "
                "is missing): a machine without a GPU, or a container started without GPU access (docker --gpus all).")
    shown = "" if visible is None else f" CUDA_VISIBLE_DEVICES={visible!r} may hide them."
    return ("TensorFlow is a CUDA build and an NVIDIA driver is loaded, but TensorFlow sees no "
            "GPU: the driver may be older than the CUDA libraries TensorFlow needs, or they may "
            f"be missing (pip install tensorflow[and-cuda]); TensorFlow's log says which.{shown}")


def onednn_lines(comparison):
    """The report's lines about `TF_ENABLE_ONEDNN_OPTS=1` from a `kmix.route.onednn.Comparison`: figures, verdict."""
    c = comparison
    shown = lambda setting, config: f"{label(config)} {c.gflops(setting, config):.0f} GFLOP/s"  # noqa: E731
    rounds = len(next(iter(c.on.values())))
    lines = [f"TF_ENABLE_ONEDNN_OPTS=1 against =0, measured in two subprocesses in {rounds} interleaved "
             f"rounds ({c.seconds:.0f} s), the probe's MLP step {c.shape[0]}x{c.shape[1]}x{c.shape[2]}: "
             f"fastest with oneDNN {shown('on', c.best_on)}; without {shown('off', c.best_off)}."]
    if not c.enabled["on"]:
        lines.append("TensorFlow did not turn oneDNN on in the subprocess that set it: nothing to gain here.")
    elif c.faster:
        lines.append(f"With oneDNN on the step runs {c.ratio:.2f}x as fast (noise {c.noise:.0%}). Set it "
                     "before TensorFlow starts: `export TF_ENABLE_ONEDNN_OPTS=1` in the shell, or "
                     "`os.environ[\"TF_ENABLE_ONEDNN_OPTS\"] = \"1\"` before `import tensorflow`; then run "
                     "`python -m kmix doctor` again: the recommended route may change with it.")
    else:
        lines.append(f"With oneDNN on the step runs {c.ratio:.2f}x as fast, not beyond the noise "
                     f"({c.noise:.0%}): no reason to set it.")
    return lines


def format_report(facts, recommendation, onednn=None):
    """The doctor's report as text; `onednn` is a `kmix.route.onednn.Comparison` or None."""
    lines = ["Versions"] + [f"  {name:<11} {version}" for name, version in facts["versions"].items()]
    lines += ["Devices", f"  {'CPU':<11} {facts['cpu']}"]
    cpu = facts.get("cpu_features")
    if cpu:
        known = cpu.get("source") is not None
        lines.append(f"  {'':<11} {cpu['model']}" + ("" if known else " (no /proc/cpuinfo: features unknown)"))
        for flag in ("avx512_bf16", "amx_bf16", "avx512_fp16"):
            lines.append(f"  {'':<11} {flag.upper():<12} {yes_no(cpu[flag]) if known else 'unknown'}")
    if "onednn" in facts:
        setting = os.environ.get("TF_ENABLE_ONEDNN_OPTS")
        setting = ("TF_ENABLE_ONEDNN_OPTS unset: TensorFlow's default for this CPU" if setting is None else
                   f"TF_ENABLE_ONEDNN_OPTS={setting!r}")
        lines.append(f"  {'oneDNN':<11} {'on' if facts['onednn'] else 'off'} ({setting})")
    if onednn is not None:
        lines += [f"  {'':<11} {line}" for line in onednn_lines(onednn)]
    cuda = f"yes (CUDA {facts['cuda'] or '?'}, cuDNN {facts['cudnn'] or '?'})" if facts["built_with_cuda"] else "no"
    lines.append(f"  {'CUDA build':<11} {cuda}")
    for i, gpu in enumerate(facts["gpus"]):
        cores = tensor_cores(gpu["compute_capability"])
        lines += [f"  GPU {i:<7} {gpu['name']}", f"    compute capability      {capability(gpu['compute_capability'])}",
                  f"    float16 tensor cores    {yes_no(cores['float16'])}",
                  f"    bfloat16 tensor cores   {yes_no(cores['bfloat16'])}"]
    if not facts["gpus"]:
        lines += [f"  {'GPU':<11} none found",
                  f"  {'':<11} float16 tensor cores: no; bfloat16 tensor cores: no (no GPU)"]
        if reason := why_no_gpu(facts):
            lines.append(f"  {'':<11} {reason}")
    lines += ["Compilation", f"  {'XLA':<11} {facts['xla']}", f"  {'TF32':<11} {tf32_line(facts)}", str(recommendation)]
    if recommendation.probe is not None:
        lines += ["  " + line for line in str(recommendation.probe).splitlines()]
    wrap = "kmix.wrap(optimizer)" + ("  # dynamic loss scale" if recommendation.loss_scaling else "")
    lines += [f"  model = kmix.autocast(model, {recommendation.policy!r})",
              f"  with kmix.policy_scope({recommendation.policy!r}):",
              f"      model.compile(optimizer={wrap}, loss=..., jit_compile={recommendation.jit_compile})"]
    return "\n".join(lines + serving_lines(recommendation))


def serving_lines(recommendation):
    """The inference route that goes with the training route: `kmix.export` in its half dtype, or float32."""
    half = Policy(recommendation.policy).compute_dtype
    return ["Serving (the recommended route's computation; `python -m kmix bench predict` times it here)",
            "  model.export(path)  # float32: no half dtype measured faster here; kmix.export(model, path, "
            "dtype='bfloat16') halves the bytes" if half == "float32" else
            f"  kmix.export(model, path, dtype={half!r})  # weights in {half}, float32 in and out"]


def main(argv=None):
    """Prints the report; returns `{"facts": ..., "recommendation": ...}`."""
    parser = argparse.ArgumentParser(prog="python -m kmix doctor", description=(
        "Print versions, devices, compute capability, float16/bfloat16 tensor-core support, CPU features, XLA "
        "availability, and the policy and jit_compile kmix.recommend() measures to be the fastest safe route on "
        "this device."))
    parser.add_argument("--onednn-check", action=argparse.BooleanOptionalAction, default=None,
                        help="measure whether TF_ENABLE_ONEDNN_OPTS=1 would be faster, in two subprocesses "
                        "(about 20 s). Default: on a CPU-only machine where oneDNN is off")
    args = parser.parse_args(argv)
    facts = gather_facts()
    facts["versions"]["kmix"] = kmix.__version__
    recommendation = recommend()
    check = args.onednn_check if args.onednn_check is not None else not facts["gpus"] and not facts["onednn"]
    if check:
        progress("doctor: timing the probe with TF_ENABLE_ONEDNN_OPTS=1 and =0, in two subprocesses")
    comparison = compare_onednn() if check else None
    print(format_report(facts, recommendation, comparison), flush=True)
    return {"facts": facts, "recommendation": recommendation, "onednn": comparison}
