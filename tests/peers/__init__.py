"""Reference peers for the tests and the benchmarks, not part of the installed package:
a Lumberjack v1 reader that behaves like go-lumber (``lumberjack_reader``) and a Courier
receiver that behaves like the Go or Ruby receivers (``courier_receiver``), each with
test knobs (delays, refusals, partial acknowledgements).  The benchmarks import them
with ``tests/`` on ``sys.path``."""
