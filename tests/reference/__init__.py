"""The references the tests compare popjax against, in one package: plain float64 NumPy (and
transformers) implementations written independently of popjax, and the small shared inputs they
are compared on. Imported by test modules; imports no test module (tests/house/test_test_imports.py).

* `ffn`: the gated FFN's math, random layers and batches, int8 quantisation (docs/methods.md §0);
* `methods`: POP, dynamic, GRIFFIN and FLAP references (docs/methods.md §2, §5);
* `frontier`: POP's frontier variants' partition and selection, and the plan-vs-reference runner;
* `gemma3`: a float64 NumPy Gemma 3 running any FFN reference in every layer;
* `moe`: tiny mixture-of-experts models and a NumPy view of their blocks;
* `vlm`: the tiny Qwen2-VL / Qwen2.5-VL transformers models, their images and prompts;
* `qwen3_vl`: the tiny Qwen3-VL / Qwen3-VL-MoE transformers models, their images and prompts;
* `parity`: prefill and decode logits against transformers on tiny configs;
* `matrix`: a registered method made ready for a tiny family; an int8 model's dequantized twin;
* `corpus`: the byte tokenizer and tiny calibration corpus of the calibrated methods' tests;
* `lm`: log-softmax in float64, the default model's config, the digits VLM's short recipe.
"""
