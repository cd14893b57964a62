"""KV-cache decoding: tokens per second of a causal LM, tpp_tvm against ONNX Runtime and
OpenVINO on the same export, and the weight stream against the measured memory bandwidth.

Models (``transformers`` configs, random weights from a fixed seed, exported by
``tpp_tvm.cache_export`` with ``past_key_values`` inputs and ``present`` outputs, dynamic
batch, new tokens and past):

- ``gpt2``: GPT-2 small (12 layers, hidden 768, vocabulary 50257);
- ``llama``: a Llama-style decoder (8 layers, hidden 1024, GQA 16/4 heads, SwiGLU 2816);
- ``<model>-int<bits>-b<block>-l<level>`` (``llama-int4-b32-l4``): that export with every
  MatMul quantized by ONNX Runtime's ``MatMulNBitsQuantizer`` (symmetric, that
  ``accuracy_level``): ``com.microsoft:MatMulNBits``, as ``llm.py`` runs them.

Each run: a ``--prompt``-token prompt, then ``--new`` greedy tokens. tpp_tvm runs a
``DecoderSession`` (cache in capacity buckets, builds compiled ahead by ``prepare``: the
compile seconds are reported, not timed; ``tpp_tvm_int8kv``: the same with its KV cache
held as int8 rows, ``cache_dtype="int8"``); ONNX Runtime (CPU EP, IOBinding: the cache stays
in its buffers between steps) and OpenVINO (``INFERENCE_PRECISION_HINT`` f32, the cache made
stateful) run the export itself with the cache growing by one each step, as their own
generation loops do (:class:`PeerLoop`; OpenVINO stateless too, the faster on small
models). Each runtime runs in a process of its own; the
fastest of its rounds is kept; peers flush denormals as tpp_tvm does. Weight GB/s: the
bytes of the weights a decode step reads (embedding tables only gathered from excluded)
over the mean step time, against ``peak.py``'s read stream on as many threads (measured
before every round, the best kept); with the cache: the weights and the KV cache a step
reads (every cached token's keys and values), which grows with the context::

    python benchmarks/decoder.py                         # both models, 1 thread
    python benchmarks/decoder.py --models gpt2 --rounds 2 --new 32

Writes ``results/<isa>-<cpu>/decoder.md`` and ``decoder.json``.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import re
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from harness import (
    machine,
    measure_read_bandwidth,
    results_dir,
    run_header,
    stub_torchvision_ops,
    write_results,
)

CACHE = Path(tempfile.gettempdir()) / "tpp_tvm_decoder"
MODELS = ("gpt2", "llama")
#: Llama-style decoders by name: (layers, hidden, intermediate, heads, kv heads); vocabulary
#: 32000, random weights. ``llama500m``: 0.45B parameters; ``llama1b``: TinyLlama-1.1B's shape.
LLAMAS = {"llama": (8, 1024, 2816, 16, 4), "llama500m": (20, 1280, 3456, 20, 4),
          "llama1b": (22, 2048, 5632, 32, 4)}
#: OpenVINO at its own settings for LLMs (``openvino_llm``): no precision hint (bf16 where the
#: CPU has it), which turns on its int8 dynamic quantization of activations for compressed
#: weights and its u8 KV cache: what its GenAI pipelines run, not f32.
OPENVINO_LLM_CONFIG: dict = {}


#: A quantized model's name: base model, bits, block size, accuracy level.
QUANTIZED = re.compile(r"^(\w+)-int(\d+)-b(\d+)-l(\d)$")


def export(name: str) -> Path:
    """The model's KV-cache export (cached)."""
    path = CACHE / f"{name}_cache.onnx"
    if path.exists():
        return path
    quantized = QUANTIZED.match(name)
    if quantized:
        base, bits, block, level = quantized.groups()
        return quantize(export(base), path, int(bits), int(block), int(level))
    import torch

    stub_torchvision_ops()
    import transformers

    from tpp_tvm.cache_export import export_causal_lm_with_cache

    CACHE.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    if name == "gpt2":
        model = transformers.GPT2LMHeadModel(transformers.GPT2Config())
    else:
        layers, hidden, inner, heads, kv_heads = LLAMAS[name]
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
            num_hidden_layers=layers, hidden_size=hidden, intermediate_size=inner,
            num_attention_heads=heads, num_key_value_heads=kv_heads, vocab_size=32000))
    return export_causal_lm_with_cache(model.eval(), path)


def quantize(source: Path, path: Path, bits: int, block: int, level: int) -> Path:
    """``source`` with its MatMuls as ``MatMulNBits`` (ONNX Runtime's quantizer), at ``path``."""
    import onnx
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    quantizer = MatMulNBitsQuantizer(onnx.load(str(source)), bits=bits, block_size=block,
                                     is_symmetric=True, accuracy_level=level)
    quantizer.process()
    onnx.save(quantizer.model.model, str(path))
    return path


def initializer_bytes(path: Path) -> int:
    """Bytes of every initializer of the file (what a runtime holding its weights once
    holds)."""
    import onnx

    model = onnx.load(str(path))
    return sum(int(np.prod(t.dims)) * np.dtype(
        onnx.helper.tensor_dtype_to_np_dtype(t.data_type)).itemsize
        for t in model.graph.initializer)


def resident_mb() -> float:
    """This process's resident memory (MB)."""
    import psutil

    return psutil.Process().memory_info().rss / 1e6


def weight_bytes(path: Path) -> int:
    """Bytes of the weights one decode step reads: every initializer except tables only
    gathered from (a token's embedding row is all a step reads of those)."""
    import onnx

    model = onnx.load(str(path))
    uses: dict[str, set[tuple[str, int]]] = {}
    for node in model.graph.node:
        for i, name in enumerate(node.input):
            uses.setdefault(name, set()).add((node.op_type, i))
    return sum(int(np.prod(t.dims)) * np.dtype(
        onnx.helper.tensor_dtype_to_np_dtype(t.data_type)).itemsize
        for t in model.graph.initializer if uses.get(t.name, set()) != {("Gather", 0)})


def cache_bytes_per_token(path: Path) -> dict[str, int]:
    """Bytes of the KV cache one token holds, which every later step reads, by how the cache
    is held: ``"float32"``, each past input's row (heads x head size) in the export's
    dtype; ``"int8"``, int8 rows with an fp32 scale each."""
    import onnx

    from tpp_tvm.cache_layout import cache_layout

    layout = cache_layout(onnx.load(str(path), load_external_data=False))
    total = {"float32": 0, "int8": 0}
    for dims in layout.cache_shapes:
        row = [d for i, d in enumerate(dims) if i not in (0, layout.axis)]
        if not all(isinstance(d, int) for d in row):
            raise ValueError(f"a symbolic cache dim in {dims}")
        total["float32"] += int(np.prod(row)) * np.dtype(layout.cache_dtype).itemsize
        total["int8"] += int(np.prod(row[:-1])) * (row[-1] + 4)
    return total


class PeerLoop:
    """Greedy generation on a runtime that takes the export as it is, each at its best
    documented setting: ONNX Runtime with IOBinding (the cache stays in ORT's own buffers
    from one step to the next: only the token, mask and positions are fed and only the
    logits read back), OpenVINO with the cache made stateful (``MakeStateful``: past and
    present become the request's internal state, as its own generation pipelines run)."""

    def __init__(self, impl: str, path: Path, threads: int) -> None:
        import onnx

        from tpp_tvm.decoding import cache_layout

        model = onnx.load(str(path), load_external_data=False)
        self.layout = cache_layout(model)
        self.outputs = [v.name for v in model.graph.output]
        self.generate = {
            "onnxruntime": self._onnxruntime,
            "openvino": self._openvino,
            "openvino_llm": lambda p, t: self._openvino(p, t, OPENVINO_LLM_CONFIG),
            "openvino_stateless": self._openvino_stateless}[impl](path, threads)

    def _feed(self, ids: np.ndarray, total: int) -> dict[str, np.ndarray]:
        lay, batch = self.layout, ids.shape[0]
        return {lay.tokens: ids, lay.mask: np.ones((batch, total), np.int64),
                lay.positions: np.arange(total - ids.shape[1], total)[None].repeat(batch, 0)}

    def _empty_cache(self, batch: int) -> dict[str, np.ndarray]:
        lay = self.layout
        return {name: np.zeros([batch, *(d if isinstance(d, int) else 0 for d in dims[1:])],
                               lay.cache_dtype)  # the past axis: empty
                for name, dims in zip(lay.past, lay.cache_shapes)}

    def _onnxruntime(self, path: Path, threads: int):
        import onnxruntime as ort

        lay = self.layout
        opts = ort.SessionOptions()
        opts.intra_op_num_threads, opts.inter_op_num_threads = threads, 1
        opts.add_session_config_entry("session.set_denormal_as_zero", "1")
        sess = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])

        def generate(prompt: np.ndarray, new: int):
            batch, length = prompt.shape
            cache = {k: ort.OrtValue.ortvalue_from_numpy(v)
                     for k, v in self._empty_cache(batch).items()}
            tokens, steps, ids = [], [], prompt
            t0 = time.perf_counter()
            prefill = 0.0
            for i in range(new):
                binding = sess.io_binding()
                for k, v in self._feed(ids, length + i).items():
                    binding.bind_cpu_input(k, v)
                for k, v in cache.items():
                    binding.bind_ortvalue_input(k, v)
                for name in self.outputs:
                    binding.bind_output(name, "cpu")
                sess.run_with_iobinding(binding)
                out = dict(zip(self.outputs, binding.get_outputs()))
                cache = {p: out[q] for p, q in zip(lay.past, lay.present)}
                tokens.append(out[lay.logits].numpy()[:, -1].argmax(-1))
                ids = tokens[-1][:, None].astype(np.int64)
                t0, prefill = self._tick(t0, i, prefill, steps)
            return np.stack(tokens, 1), prefill, steps
        return generate

    def _openvino(self, path: Path, threads: int, config: dict | None = None):
        import openvino as ov
        from openvino._offline_transformations import apply_make_stateful_transformation

        lay = self.layout
        core = ov.Core()
        model = core.read_model(str(path))
        apply_make_stateful_transformation(model, dict(zip(lay.past, lay.present)))
        config = {"INFERENCE_PRECISION_HINT": "f32"} if config is None else config
        compiled = core.compile_model(model, "CPU", {
            **config, "INFERENCE_NUM_THREADS": threads, "CPU_DENORMALS_OPTIMIZATION": True})
        request = compiled.create_infer_request()
        variables = {p + q: p for p, q in zip(lay.past, lay.present)}

        def generate(prompt: np.ndarray, new: int):
            # the cache starts empty, batch rows of it (an unset state has batch 0 too)
            empty = self._empty_cache(prompt.shape[0])
            for state in request.query_state():  # named past + present by MakeStateful
                state.state = ov.Tensor(empty[variables[state.name]])
            length = prompt.shape[1]
            tokens, steps, ids = [], [], prompt
            t0 = time.perf_counter()
            prefill = 0.0
            for i in range(new):
                logits = request.infer(self._feed(ids, length + i))[compiled.output(lay.logits)]
                tokens.append(np.asarray(logits)[:, -1].argmax(-1))
                ids = tokens[-1][:, None].astype(np.int64)
                t0, prefill = self._tick(t0, i, prefill, steps)
            return np.stack(tokens, 1), prefill, steps
        return generate

    def _openvino_stateless(self, path: Path, threads: int):
        """OpenVINO on the export as it is, the cache fed and read back every step: on
        small models its stateful form's per-step overhead costs more than the cache copy
        (a 2-layer GPT-2: 1.26 ms a step stateful, 0.65 stateless), so both are timed."""
        import openvino as ov

        lay = self.layout
        compiled = ov.Core().compile_model(str(path), "CPU", {
            "INFERENCE_PRECISION_HINT": "f32", "INFERENCE_NUM_THREADS": threads,
            "CPU_DENORMALS_OPTIMIZATION": True})
        request = compiled.create_infer_request()
        names = [o.get_any_name() for o in compiled.outputs]

        def generate(prompt: np.ndarray, new: int):
            length = prompt.shape[1]
            cache = self._empty_cache(prompt.shape[0])
            tokens, steps, ids = [], [], prompt
            t0 = time.perf_counter()
            prefill = 0.0
            for i in range(new):
                result = request.infer(self._feed(ids, length + i) | cache)
                out = {name: result[o] for name, o in zip(names, compiled.outputs)}
                cache = {p: out[q] for p, q in zip(lay.past, lay.present)}
                tokens.append(out[lay.logits][:, -1].argmax(-1))
                ids = tokens[-1][:, None].astype(np.int64)
                t0, prefill = self._tick(t0, i, prefill, steps)
            return np.stack(tokens, 1), prefill, steps
        return generate

    @staticmethod
    def _tick(t0: float, i: int, prefill: float, steps: list[float]) -> tuple[float, float]:
        """Step ``i`` finished: the first is the prefill, the others decode steps."""
        now = time.perf_counter()
        if i == 0:
            prefill = now - t0
        else:
            steps.append(now - t0)
        return now, prefill


#: tpp_tvm's rows: a ``DecoderSession`` holding its KV cache in this dtype.
TPP_SESSIONS = {"tpp_tvm": "float32", "tpp_tvm_int8kv": "int8"}


def run_model(name: str, prompt_len: int, new: int, rounds: int, threads: int,
              impls: list[str]) -> list[dict]:
    return run_export(name, export(name), prompt_len, new, rounds, threads, impls)


def run_export(name: str, path: Path, prompt_len: int, new: int, rounds: int, threads: int,
               impls: list[str]) -> list[dict]:
    """Rows of each runtime in ``impls`` generating from the export at ``path``."""
    from tpp_tvm.decoding import DecoderSession

    prompt = np.random.default_rng(0).integers(0, 1000, (1, prompt_len)).astype(np.int64)
    loops = {}
    compile_s = None
    for impl in (i for i in impls if i in TPP_SESSIONS):
        t0 = time.perf_counter()
        session = DecoderSession(str(path), cache_dtype=TPP_SESSIONS[impl])
        session.prepare(prompt_len, prompt_len + new)
        compile_s = time.perf_counter() - t0

        def tpp(prompt=prompt, session=session):
            g = session.generate(prompt, new)
            return g.tokens, g.prefill_seconds, g.step_seconds
        loops[impl] = tpp
    for impl in impls:
        if impl not in TPP_SESSIONS:
            loops[impl] = lambda p=PeerLoop(impl, path, threads): p.generate(prompt, new)
    best: dict[str, dict] = {}
    tokens = {}
    prefill_ms: dict[str, float] = {}
    bandwidth = 0.0
    for _ in range(rounds):
        # Measured between the rounds, the best kept: the machine's bandwidth drifts too.
        bandwidth = max(bandwidth, measure_read_bandwidth(threads))
        for impl, loop in loops.items():
            toks, prefill, steps = loop()
            tokens[impl] = toks
            row = {"model": name, "impl": impl, "prompt": prompt_len, "new": new,
                   "prefill_ms": 1e3 * prefill, "step_ms": 1e3 * float(np.mean(steps)),
                   "tokens_per_s": len(steps) / sum(steps)}
            prefill_ms[impl] = min(prefill_ms.get(impl, np.inf), row["prefill_ms"])
            if impl not in best or row["step_ms"] < best[impl]["step_ms"]:
                best[impl] = row
            print(f"[decoder] {name} {impl}: prefill {row['prefill_ms']:.1f} ms, step "
                  f"{row['step_ms']:.2f} ms, {row['tokens_per_s']:.1f} tok/s",
                  file=sys.stderr, flush=True)
    resident = resident_mb()  # one runtime per process (run_apart): the model's runtime
    nbytes = weight_bytes(path)
    per_token = cache_bytes_per_token(path)
    for impl, row in best.items():
        row["resident_mb"] = resident
        row["initializer_mb"] = initializer_bytes(path) / 1e6
        row["prefill_ms"] = prefill_ms[impl]
        row["bandwidth_gb_s"] = bandwidth
        row["weight_gb_s"] = nbytes / (row["step_ms"] * 1e-3) / 1e9
        row["weight_mb"] = nbytes / 1e6
        # The cache a step reads: the past of each step (prompt + 1 .. prompt + new - 1
        # tokens) and its own row, on average prompt + new / 2 tokens.
        cache = per_token[TPP_SESSIONS.get(impl, "float32")] * (prompt_len + new / 2)
        row["cache_mb"] = cache / 1e6
        row["stream_gb_s"] = (nbytes + cache) / (row["step_ms"] * 1e-3) / 1e9
        row["tokens"] = tokens[impl].tolist()
        if "tpp_tvm" in tokens:
            row["tokens_match_tpp"] = bool((tokens[impl] == tokens["tpp_tvm"]).all())
        if impl in TPP_SESSIONS:
            row["compile_s"] = compile_s
    return list(best.values())


def run_apart(name: str, args: argparse.Namespace, prompt: int, threads: int) -> list[dict]:
    """:func:`run_model` with each runtime in a process of its own (an idle runtime's
    worker threads slow the next one in the same process), rows compared by their tokens."""
    rows = []
    for impl in args.impls.split(","):
        cmd = [sys.executable, __file__, "--worker", "--models", name, "--impls", impl,
               "--prompt", str(prompt), "--new", str(args.new), "--rounds",
               str(args.rounds), "--threads", str(threads)]
        out = subprocess.run(cmd, capture_output=True, text=True)
        sys.stderr.write(out.stderr[-2000:])
        if out.returncode != 0:
            raise RuntimeError(f"{impl} on {name} failed: {out.stderr[-500:]}")
        rows += [{**row, "threads": threads}
                 for row in json.loads(out.stdout.strip().splitlines()[-1])]
    tpp = next((r["tokens"] for r in rows if r["impl"] == "tpp_tvm"), None)
    for row in rows:
        if tpp is not None:
            row["tokens_match_tpp"] = row["tokens"] == tpp
    return rows


def render(rows: list[dict], threads: str, command: str, date: str, load: str,
           title: str = "KV-cache decoding: tokens per second") -> str:
    lines = [f"# {title}", "",
             *run_header(machine(), date, command, load),
             f"- {threads} thread(s). A process per runtime; the fastest round of each. "
             "tpp_tvm: `DecoderSession` (cache in capacity buckets, builds compiled ahead); "
             "ORT (IOBinding, the cache kept in its buffers) and OpenVINO f32 (the cache "
             "made stateful): the export itself, cache growing; denormals flushed by all.",
             f"- Weight GB/s: bytes of the weights a decode step reads (initializers, less "
             "embedding tables only gathered from) / step time; bandwidth GB/s: "
             f"`peak.py --stream read` on {threads} thread(s), measured by each runtime's "
             "process before every round (the best kept); \"of bandwidth\" divides by the "
             "highest of the run's at that thread count (a process that measured a slow "
             "moment would flatter its row). Resident MB: the runtime's whole process after "
             "its rounds (Python, the runtime, its model, buffers), beside the file's "
             "initializers.",
             "- Cache MB: the KV cache a step reads besides the weights (every cached token's "
             "keys and values, prompt + new / 2 tokens on average; int8 rows with their "
             "scales for `tpp_tvm_int8kv`); \"with cache\": weights and cache over the step "
             "time, of the same bandwidth.",
             "",
             "| model | threads | runtime | prefill ms | step ms | tokens/s | tpp_tvm "
             "speed-up | weight GB/s | bandwidth GB/s | of bandwidth | cache MB | with cache "
             "| same tokens as tpp_tvm | compile s | resident MB (file weights) |",
             "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|"]
    runs = dict.fromkeys((r["model"], r["prompt"], r.get("threads", threads)) for r in rows)
    peak: dict = {}  # the run's highest read stream per thread count
    for r in rows:
        at = r.get("threads", threads)
        peak[at] = max(peak.get(at, 0.0), r["bandwidth_gb_s"])
    for model, prompt, run_threads in runs:
        mine = [r for r in rows if (r["model"], r["prompt"], r.get("threads", threads))
                == (model, prompt, run_threads)]
        tpp = next((r for r in mine if r["impl"] == "tpp_tvm"), None)
        for r in mine:
            speedup = f"{tpp['tokens_per_s'] / r['tokens_per_s']:.2f}" if tpp else "-"
            compiled = f"{r['compile_s']:.1f}" if r.get("compile_s") is not None else "-"
            lines.append(
                f"| {model} ({r['weight_mb']:.0f} MB, {r['prompt']}+{r['new']}) | "
                f"{run_threads} | {r['impl']} "
                f"| {r['prefill_ms']:.1f} | {r['step_ms']:.2f} | {r['tokens_per_s']:.1f} | "
                f"{speedup} | {r['weight_gb_s']:.1f} | {r['bandwidth_gb_s']:.1f} | "
                f"{r['weight_gb_s'] / peak[run_threads]:.0%} | "
                f"{_with_cache(r, peak[run_threads])} | "
                f"{r.get('tokens_match_tpp', '-')} | {compiled} | "
                f"{_resident(r)} |")
    return "\n".join(lines) + "\n"


def _with_cache(row: dict, bandwidth: float) -> str:
    """The cache MB and the stream with it, of ``bandwidth`` (rows of older runs: -)."""
    if "cache_mb" not in row:
        return "- | -"
    return f"{row['cache_mb']:.1f} | {row['stream_gb_s'] / bandwidth:.0%}"


def _resident(row: dict) -> str:
    if row.get("resident_mb") is None:
        return "-"
    return f"{row['resident_mb']:.0f} ({row['initializer_mb']:.0f})"


#: What ``--memory`` measures, and the module each runtime is imported as.
MEMORY_TITLE = "Weight-only quantized LLM: resident memory per runtime"
_RUNTIME_MODULES = {"tpp_tvm": "tpp_tvm.decoding", "tpp_tvm_int8kv": "tpp_tvm.decoding",
                    "onnxruntime": "onnxruntime",
                    "openvino": "openvino", "openvino_llm": "openvino"}


def measure_memory(name: str, impl: str, prompt_len: int, new: int) -> dict:
    """One runtime's memory (MB) holding the export ``name`` and generating from it."""
    path = export(name)
    prompt = np.random.default_rng(0).integers(0, 1000, (1, prompt_len)).astype(np.int64)
    before = resident_mb()
    importlib.import_module(_RUNTIME_MODULES[impl])
    if impl in TPP_SESSIONS:
        # Each build hands back the compiler's code pages (including those the import
        # touched): the import is counted as it stays, not charged to the model.
        from tpp_tvm.profiling import release_compiler_pages

        release_compiler_pages()
    imported = resident_mb()
    if impl in TPP_SESSIONS:
        from tpp_tvm.decoding import DecoderSession

        session = DecoderSession(str(path), cache_dtype=TPP_SESSIONS[impl])
        session.prepare(prompt_len, prompt_len + new)
        loaded = resident_mb()
        session.generate(prompt, new)
    else:
        loop = PeerLoop(impl, path, int(os.environ.get("TVM_NUM_THREADS", "1")))
        loaded = resident_mb()
        loop.generate(prompt, new)
    after = resident_mb()
    return {"model": name, "impl": impl, "prompt": prompt_len, "new": new,
            "before_mb": before, "import_mb": imported - before, "loaded_mb": loaded - imported,
            "generated_mb": after - loaded,
            "peak_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e3,
            "initializer_mb": initializer_bytes(path) / 1e6}


def render_memory(rows: list[dict], command: str, date: str, load: str) -> str:
    lines = [f"# {MEMORY_TITLE}", "", *run_header(machine(), date, command, load),
             "- A process per runtime (1 thread). MB of resident memory: the process before "
             "the runtime is imported; what importing it adds (tpp_tvm: after handing back the "
             "compiler library's code pages, as each build does); what loading the model adds "
             "(tpp_tvm: the session with its prompt and step builds compiled); what "
             "generating adds; the process's peak (tpp_tvm's while compiling). \"x file\" "
             "divides the loaded model's MB by the file's initializer MB.", "",
             "| model | runtime | process before | + import | + model | x file | "
             "+ generating | peak | file initializers |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(
            f"| {r['model']} ({r['prompt']}+{r['new']}) | {r['impl']} | {r['before_mb']:.0f} | "
            f"{r['import_mb']:.0f} | {r['loaded_mb']:.0f} | "
            f"{r['loaded_mb'] / r['initializer_mb']:.2f} | "
            f"{r['generated_mb']:.0f} | {r['peak_mb']:.0f} | {r['initializer_mb']:.0f} |")
    return "\n".join(lines) + "\n"


def memory_main(args: argparse.Namespace, argv: list[str]) -> int:
    """``--memory``: :func:`measure_memory` of each model and runtime, a process each."""
    if args.worker:
        print(json.dumps(measure_memory(args.models, args.impls, int(args.prompt), args.new)))
        return 0
    load_before = os.getloadavg()[0]
    rows = []
    for name in args.models.split(","):
        export(name)  # once, before the workers
        for impl in args.impls.split(","):
            cmd = [sys.executable, __file__, "--memory", "--worker", "--models", name,
                   "--impls", impl, "--prompt", args.prompt, "--new", str(args.new)]
            out = subprocess.run(cmd, capture_output=True, text=True,
                                 env={**os.environ, "TVM_NUM_THREADS": "1"})
            if out.returncode != 0:
                raise RuntimeError(f"{impl} on {name} failed: {out.stderr[-800:]}")
            rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(f"[llm_memory] {rows[-1]}", file=sys.stderr, flush=True)
    write_results(args.out or str(results_dir()), args.name, argv, rows, load_before,
                  lambda command, date, load: render_memory(rows, command, date, load),
                  script="decoder")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--prompt", default="128", help="prompt lengths, comma-separated")
    parser.add_argument("--new", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", default="1", help="thread counts, comma-separated")
    parser.add_argument("--impls", default="tpp_tvm,onnxruntime,openvino,openvino_stateless")
    parser.add_argument("--out", help="folder for decoder.md/json (default: results/<cpu>)")
    parser.add_argument("--name", default="decoder", help="the result files' name")
    parser.add_argument("--title", default="KV-cache decoding: tokens per second")
    parser.add_argument("--memory", action="store_true",
                        help="resident memory per runtime instead of speed (llm_memory.py)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.memory:
        return memory_main(args, argv)
    if args.worker:
        os.environ["TVM_NUM_THREADS"] = args.threads
        print(json.dumps(run_model(args.models, int(args.prompt), args.new, args.rounds,
                                   int(args.threads), args.impls.split(","))))
        return 0
    load_before = os.getloadavg()[0]
    rows = []
    for name in args.models.split(","):
        export(name)  # once, before the workers
        for threads in (int(t) for t in args.threads.split(",")):
            for prompt in (int(n) for n in args.prompt.split(",")):
                rows += run_apart(name, args, prompt, threads)
    write_results(args.out or str(results_dir()), args.name, argv, rows, load_before,
                  lambda command, date, load: render(rows, args.threads, command, date,
                                                     load, args.title), script="decoder")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
