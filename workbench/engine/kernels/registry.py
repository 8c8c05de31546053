"""Every replacement the engine may run in place of what the model asks for, in one table.

Owns: `REGISTRY`, the declaration of each replacement (what it replaces, how it is checked, what
its verdict depends on, where the verdict is kept: verdict.Replacement). The kernels and their
checks live beside each other in their own modules and decide through book.BOOK under these names;
adding a fast path is its kernel, its check and one entry here (docs/kernels.md).
"""

from __future__ import annotations

from workbench.engine.kernels.verdict import IDENTICAL, PER_LOAD, PER_OBJECT, Replacement, Within

MACHINE = ("CPU model and flags", "torch version and build (MKL)", "kernel and check code")
MODEL = ("model weights (content hash), config, class and modeling code", "transformers and torch versions",
         "the replacement's code")
# the one-call layers: both, and the orders and lanes the other verdicts chose for each kernel they call
COMPOSED = (*MACHINE, "model weights (content hash), config, class and modeling code",
            "each called kernel's order and lanes (the plan)")
GEMM = ("workbench.engine.kernels.gemm",)
SHAPE_ROWS = ("out_features", "in_features", "bias", "rows", "threads")

_ALL = [
    Replacement("linear.packed", "F.linear (nn.Linear's forward)",
                "MKL's packed GEMM (cblas_sgemm_compute on the weight packed once, kernels/gemm.py)",
                IDENTICAL, SHAPE_ROWS, MACHINE, GEMM, native=True,
                note="16-256 rows; MKL picks its kernel by shape, row count and threads, so each is checked"),
    Replacement("linear.split", "F.linear (nn.Linear's forward)",
                "one GEMM per thread over a slice of the weight's output rows (torch.bmm, kernels/gemm.py)",
                IDENTICAL, SHAPE_ROWS, MACHINE, GEMM, native=True,
                note="1-64 rows (decode batches), two or more threads, output rows divisible by them"),
    Replacement("linear.rowdot", "F.linear (nn.Linear's forward) at one row",
                "a C dot product per output in the summation order that gives MKL's bits on this CPU "
                "(kernels/c/linear_rowdot.c)",
                IDENTICAL, SHAPE_ROWS, MACHINE, GEMM, native=True,
                note="one row (batch-1 decode); the orders are tried in turn on the layer's first 64 rows, "
                     "the first that matches is checked on all of them (the order found is in facts); the "
                     "direct forward computes layers that read the same row (q/k/v, gate/up) in one call "
                     "where each one's own route is this kernel"),
    Replacement("linear.blocked", "F.linear (nn.Linear's forward) at 2-64 rows",
                "a C GEMM in the blocked order that gives MKL's bits on this CPU (kernels/c/linear_rows.c)",
                IDENTICAL, SHAPE_ROWS, MACHINE, GEMM, native=True,
                note="decode batches; fma chains in blocks of KC products, tried per layer and row count on the "
                     "first 64 outputs, the first match checked on all of them (the order found is in facts)"),
    Replacement("linear.route", "F.linear (nn.Linear's forward)",
                "the fastest of F.linear and the kernels found identical to it (linear.packed, linear.split, "
                "linear.rowdot, linear.blocked)",
                IDENTICAL, (*SHAPE_ROWS, "entrants"), MACHINE, GEMM, native=True,
                note="every entrant is bit-identical, so the race can only change speed: timed on this "
                     "CPU with the weight out of cache (below 16 rows a sweep over 64 MB of copies of the weight, "
                     "as a decode step streams it; from 16 rows one call after 64 MB written), best of 3 rounds "
                     "each (ms a call in facts), the winner runs"),
    Replacement("attention.decode_one_row",
                "gather + scaled_dot_product_attention at one decode row (exactly transformers' attention)",
                "the paged decode-attention C kernel (kernels/c/decode_attention.c)",
                IDENTICAL, ("heads", "kv_heads", "head_dim"), MACHINE, ("workbench.engine.kernels.decode_attention",),
                native=True, on_disk="none", note="checked in every process (milliseconds)"),
    Replacement("attention.flash_one_row",
                "gather + scaled_dot_product_attention at one decode row on consecutive KV slots (transformers' "
                "attention)", "one C call replaying torch's CPU flash-attention kernel (kernels/c/flash_row.c): MKL's "
                "own sgemm for q.K and p.V, ATen's exp_u20 and sums, its scratch at the same offsets",
                IDENTICAL, ("heads", "kv_heads", "head_dim", "threads"), MACHINE,
                ("workbench.engine.kernels.decode_attention",), native=True, on_disk="none",
                note="compared with sdpa on 15 probe rows (1-1100 keys) at each vector width (16: AVX512, 8: "
                "AVX2), the first matching all kept (lanes in facts); checked in every process"),
    Replacement("attention.decode_batch", "gather + masked scaled_dot_product_attention at several decode rows",
                "the paged decode-attention C kernel (kernels/c/decode_attention.c)",
                Within("4x sdpa's own error against a float64 reference",
                       "at several rows sdpa's bits depend on the batch's padding: there is no single result "
                       "to be identical to"),
                ("heads", "kv_heads", "head_dim"), MACHINE, ("workbench.engine.kernels.decode_attention",),
                native=True, on_disk="none", note="checked in every process (milliseconds)"),
    Replacement("sample.draw", "the sampler's float64-cumsum inverse-CDF draw (torch)",
                "wb_sample_draw (kernels/c/sample_draw.c)", IDENTICAL, (), MACHINE,
                ("workbench.engine.kernels.sampling",), native=True, on_disk="none",
                note="compared on 80 seeded probe rows; checked in every process"),
    Replacement("sample.rank_count", "the logprobs' compare-and-count of each token's rank (torch)",
                "wb_count_above (kernels/c/sample_draw.c)", IDENTICAL, (), MACHINE,
                ("workbench.engine.kernels.sampling",), native=True, on_disk="none",
                note="compared on 80 seeded probe rows; checked in every process"),
    Replacement("sample.argmax", "torch.argmax of each row of logits (the greedy pick)",
                "wb_argmax (kernels/c/sample_draw.c): the row's maximum and whether it holds a NaN, then the "
                "first index equal to it (or the first NaN)", IDENTICAL, (), MACHINE,
                ("workbench.engine.kernels.sampling",), native=True, on_disk="none",
                note="compared on 80 seeded probe rows (ties, NaN, -inf rows, +0 and -0); checked in every process"),
    Replacement("sample.entropy", "the traced sampler's entropy of each row, -(p * lp).sum(-1) (torch)",
                "wb_entropy (kernels/c/layer_ops.c): the products summed in torch's order (its sum kernel's "
                "cascade, a long row cut at its parallel grain as two threads cut it)", IDENTICAL, ("threads",),
                MACHINE, ("workbench.engine.kernels.sampling",), native=True, on_disk="passed",
                note="vocabularies of 64 or more; each vector width tried on 18 probe batches (1-32 rows, 64 to "
                "151936 tokens), the first matching all kept (lanes in facts); 0.15 s, so kept on disk"),
    Replacement("sample.topk", "torch.topk of the traced sampler's distributions (values, ids, tie order)",
                "wb_topk (kernels/c/topk.c): libstdc++'s partial_sort, which torch.topk runs, replayed on a "
                "k-sized heap", IDENTICAL, (), MACHINE, ("workbench.engine.kernels.sampling",), native=True,
                on_disk="none", note="k * 64 <= vocabulary only (torch's partial_sort path); compared on 40 "
                "tie-heavy probe rows per k; checked in every process"),
    Replacement("sample.log_softmax", "torch.log_softmax of each row of logits (the sampler's raw logprobs) and "
                "torch.argmax of it (the greedy pick)",
                "wb_log_softmax (kernels/c/layer_ops.c): ATen's steps per row at its vector width (the maximum, "
                "SLEEF's exp summed in vec::map_reduce_all's order, SLEEF's log), the argmax from the same maximum; "
                "one row cut between the threads (the exps of its later parts added after the first's, in order)",
                IDENTICAL, (), MACHINE, ("workbench.engine.kernels.sampling",), native=True, on_disk="passed",
                note="vocabularies of 64 or more; rows with a NaN or an infinite maximum go to torch; each width (16 "
                "and 8 lanes) tried on 97 probes (32 batches of 4 rows, 65 rows alone), the first matching all kept "
                "(lanes in facts); 0.1 s, so kept on disk"),
    Replacement("sample.model_record", "the traced sampler's record of each row's own distribution: "
                "torch.softmax(logits), torch.topk of it and -(p * lp).sum(-1) (three passes over an [R, V] tensor)",
                "wb_log_softmax with k (kernels/c/layer_ops.c): in the same pass per row, the log-softmax's exps "
                "kept and scaled by the reciprocal of their sum (ATen's softmax), 16384 floats at a time while "
                "they are in cache, into the sample.topk heap and the sample.entropy sum; one row cut between the "
                "threads at torch's entropy chunks (the parts' top-k merged by replaying each later part's "
                "entrants)",
                IDENTICAL, ("threads",), MACHINE, ("workbench.engine.kernels.sampling",), native=True,
                on_disk="passed", note="where sample.log_softmax, sample.topk and sample.entropy apply; compared on "
                "the 97 probes at each k that applies; 0.4 s, so kept on disk"),
    Replacement("norm.rms", "transformers' RMSNorm forward (pow, mean, add, rsqrt, two muls) and the residual add "
                "before it", "one C pass per row (kernels/c/layer_ops.c) in torch's own order for the mean's sum",
                IDENTICAL, ("class", "hidden", "eps"), MACHINE, ("workbench.engine.kernels.layer_ops",), native=True,
                on_disk="none", note="inside the direct forward; torch's float sum order (ATen's SumKernel) is tried "
                "at each vector width on probe rows against the model's own norm, the first that matches them all "
                "is kept (lanes in facts); checked in every process"),
    Replacement("rotary.apply", "transformers' apply_rotary_pos_emb (q and k: 14 torch ops)",
                "one C pass (kernels/c/layer_ops.c): two rounded products and a rounded sum per element, as torch",
                IDENTICAL, ("heads", "kv_heads", "head_dim"), MACHINE, ("workbench.engine.kernels.layer_ops",),
                native=True, on_disk="none", note="inside the direct forward; checked in every process"),
    Replacement("mlp.silu_mul", "LlamaMLP's act_fn(gate) * up with a SiLU activation (two torch ops)",
                "one C pass (kernels/c/layer_ops.c): x / (1 + exp(-x)) with SLEEF's expf_u10 as torch's vectorized "
                "SiLU computes it, then the product", IDENTICAL, ("class",), MACHINE,
                ("workbench.engine.kernels.layer_ops",), native=True, on_disk="none",
                note="inside the direct forward; compared with the model's activation module on probes spanning "
                "nine decades, exp's under- and overflow, infinities and NaN; checked in every process"),
    Replacement("forward.decode_layers", "the direct forward's layers at one decode row (~15 Python calls a layer "
                "around norm.rms, linear.rowdot, rotary.apply, the KV write, attention.flash_one_row and mlp.silu_mul)",
                "one C call a step making those same kernel calls with the same arguments in the same order "
                "(kernels/c/decode_layers.c)", IDENTICAL, ("threads",), COMPOSED,
                ("workbench.engine.kernels.decode_layers",), native=True, lives=PER_OBJECT, on_disk="passed",
                note="only where each of those kernels' own checks passed and this step is one row on consecutive "
                     "slots with the engine's attention, no capture, hook or sliding window; checked per model "
                     "object on a one-row decode over 40 keys of scratch KV (logits and every layer's K/V), or "
                     "read from disk where an earlier process passed it for the same model and plan"),
    Replacement("forward.decode_layers_rows", "the direct forward's layers at several decode rows (~15 Python calls "
                "a layer around norm.rms, linear.blocked, rotary.apply, the KV write, attention.decode_batch and "
                "mlp.silu_mul)",
                "one C call a step making those same kernel calls with the same arguments in the same order "
                "(kernels/c/decode_layers.c)", IDENTICAL, ("threads", "rows"), COMPOSED,
                ("workbench.engine.kernels.decode_layers",), native=True, lives=PER_OBJECT, on_disk="passed",
                note="only where each of those kernels' own checks passed (every projection's linear.blocked at "
                     "this row count: F.linear's bits, whichever kernel its race picked) and the step is decode "
                     "rows only, with the engine's attention, no capture, hook or sliding window; checked per model "
                     "object and row count on a decode of rows of different lengths over seeded K/V (logits and "
                     "every layer's K/V), or read from disk where an earlier process passed it for the same model "
                     "and plan"),
    Replacement("forward.direct", "the model's own forward (module dispatch, transformers' decorators)",
                "the direct forward: the same torch ops in the same order without the dispatch "
                "(run/exact_forward.py)", IDENTICAL, ("model",), MODEL, ("workbench.engine.run.exact_forward",),
                lives=PER_OBJECT, on_disk="passed",
                note="logits, every layer's K/V and attention keywords on an extend, a mixed and a decode forward; "
                     "exact mode, transformers' Llama, Mistral, Qwen2 and Qwen3 only"),
    Replacement("attention.variants", "the model's own attention implementation",
                "the engine's attention over its KV pool (run/attention.py), per layer as the probe found it",
                IDENTICAL, ("model",), MODEL, ("workbench.engine.run.variants",), lives=PER_LOAD, on_disk="passed",
                note="a probe forward records the keywords each layer passes to attention; a model whose "
                     "attention the engine does not compute as transformers does is refused (ValueError)"),
]
REGISTRY: dict[str, Replacement] = {r.name: r for r in _ALL}
