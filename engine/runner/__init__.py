"""A batch plan -> tensors -> one model forward -> a `StepOutput` for the sampler.

`paged.PagedRunner` is the fast path: all scheduled tokens in one flat row, attention through
`engine.attention.paged_attention` on the paged cache, decode steps (and short prompt chunks) on
`native.NativeDecoder` where the model is one it computes. `fallback.FallbackRunner` serves models
whose layers do not call transformers' attention interface (Bloom, Falcon, remote code): one
forward per sequence with its own `DynamicCache`, correct but unbatched. Which runner a model gets
is decided in `engine.model.setup`.
"""
