"""`axon bench`: benchmarks of a running server, with vLLM's metric definitions.

`serve` (the command; its flags in `args`) sweeps concurrency or request rate against any
OpenAI-compatible URL; `client` sends the streamed requests, `metrics` turns their timestamps
into TTFT / TPOT / ITL / E2E and throughput, `prompts` makes random or file-based prompts,
`report` and `plot` print and draw the results. No torch (transformers only for --tokenizer).
"""
