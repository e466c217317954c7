"""The model side of the engine: loading (`loading`, `gguf`), block-quantized weights (`quant`), where
the linears run (`linears`), the KV pool's size (`memory`) and the runner a model gets (`setup`)."""
