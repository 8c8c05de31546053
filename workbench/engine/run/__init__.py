"""Running the model: the ForwardBatch, the ModelRunner over the unmodified HF model, the attention
function that reads and writes the paged KV pool, the load-time probe of each layer's attention
variant (variants.py), and the native CPU kernels."""
