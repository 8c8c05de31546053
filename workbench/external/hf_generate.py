"""Record a trace of the engine's schema from Hugging Face transformers `generate()`.

Owns: running a stock transformers model one prompt at a time and writing `request.added`,
`token` (id, text, logprob, rank, top-k alternatives), `request.finished` events, so
`workbench diff engine.wbtrace hf.wbtrace` compares the engine with transformers. torch and
transformers are imported only when `record_hf_trace` runs; importing this module loads neither.
"""

from __future__ import annotations

import time
from typing import Any

from workbench.trace import events as ev
from workbench.trace.store import TraceWriter


def record_hf_trace(path: str, model_spec: str, prompts: list[Any], *, max_new_tokens: int | list[int] = 32,
                    topk: int = 10, req_ids: list[str] | None = None) -> str:
    """Greedy `generate()` for each prompt (a string, a chat, or token ids), written to `path` as a .wbtrace.

    `req_ids` names the requests (defaults to the engine's `req-0`, `req-1`, ...) so the two traces
    line up by id; `max_new_tokens` is one limit or one per prompt. The model is the stock
    transformers model (sdpa attention), not the engine's.
    """
    import torch
    import transformers

    from workbench.models.loader import folder_hash, load_weights, resolve_folder

    folder, name = resolve_folder(model_spec)
    model = load_weights(folder).eval()
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    ids_list = req_ids or [f"req-{i}" for i in range(len(prompts))]
    writer = TraceWriter(path)
    writer.set_meta("engine", {"model": model_spec, "adapter": "transformers.generate"})
    writer.set_meta("model", {"spec": model_spec, "name": name, "hash": folder_hash(folder), "device": "cpu",
                              "dtype": "float32"})
    writer.set_meta("versions", {"transformers": transformers.__version__, "torch": torch.__version__})
    writer.set_meta("trace_level", "summary")
    step = 0
    limits = max_new_tokens if isinstance(max_new_tokens, list) else [max_new_tokens] * len(prompts)
    for rid, prompt, max_new_tokens in zip(ids_list, prompts, limits, strict=True):
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            prompt_ids = list(prompt)
        elif isinstance(prompt, str):
            prompt_ids = tok(prompt).input_ids
        else:
            prompt_ids = list(tok.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True)["input_ids"])
        step += 1
        t0 = time.perf_counter()
        writer.write(ev.RequestAdded(step=step, req_id=rid, t=t0, prompt=prompt, prompt_ids=list(prompt_ids),
                                     params={"temperature": 0.0, "max_new_tokens": max_new_tokens}))
        with torch.inference_mode():
            out = model.generate(torch.tensor([prompt_ids]), attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
                                 max_new_tokens=max_new_tokens, do_sample=False, output_logits=True,
                                 return_dict_in_generate=True, pad_token_id=tok.eos_token_id)
        new_ids = out.sequences[0, len(prompt_ids):].tolist()
        for pos, (tid, logits) in enumerate(zip(new_ids, out.logits, strict=False)):
            step += 1
            logp = torch.log_softmax(logits[0].float(), dim=-1)
            vals, top = logp.topk(topk)
            chosen = float(logp[tid])
            writer.write(ev.TokenChosen(
                step=step, req_id=rid, t=time.perf_counter(), position=pos, token_id=tid,
                text=tok.decode([tid]), logprob=chosen, rank=int((logp > chosen).sum()) + 1,
                top_logprobs=[[i, v, tok.decode([i])] for i, v in zip(top.tolist(), vals.tolist(), strict=True)]))
        reason = "stop" if new_ids and new_ids[-1] == tok.eos_token_id else "length"
        writer.write(ev.RequestFinished(step=step, req_id=rid, t=time.perf_counter(),
                                        text=tok.decode(new_ids, skip_special_tokens=True), output_ids=new_ids,
                                        finish_reason=reason, usage={"prompt_tokens": len(prompt_ids),
                                                                     "completion_tokens": len(new_ids)}))
    writer.close()
    return path
