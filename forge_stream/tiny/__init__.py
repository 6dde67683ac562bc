"""The tiny demo model: random weights in the HuggingFace layout (`model`), its byte-level BPE tokenizer trained on
a corpus generated here (`corpus`, which holds the task suite's conversations) and its ChatML chat template with
tool calls. It sits above forge_stream.tasks, whose conversations it learns, and below what writes it: `model init`,
`sft`, the benchmarks and deploy's demo model."""
