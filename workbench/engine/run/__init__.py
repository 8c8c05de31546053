"""Running the model: the ForwardBatch, the ModelRunner over the unmodified HF model, the attention
function that reads and writes the paged KV pool, and the native CPU kernels."""
