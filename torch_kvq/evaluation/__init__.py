"""Accuracy on trained models and real text: the Brown Corpus reader (``corpus``), perplexity and
generation agreement under KV configs (``eval``), per-layer sensitivity (``sensitivity``) and
k/v scale calibration from text (``calibrate``); ``cli_*`` are the command-line entry points."""
