"""``popjax bench``: decode speed of the methods against the memory roofline and transformers
(``runner``), plus the prompt-length, capacity, streaming and memory suites (``suites``)."""
