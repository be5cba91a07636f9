"""The Triton programs: the TMA paged decode (``decode_tma``), its balanced schedule
(``decode_balanced``), the paged cache write (``kv_write``) and the device code they share
(``helpers``); what the decode runs with by default (``decode_config``, host logic).

Each submodule but ``decode_config`` imports Triton, so import one only where its kernel runs
(the kernel classes in ``attention/kernels/`` do so lazily); this package itself imports nothing,
and the CPU suite runs without Triton installed.
"""
