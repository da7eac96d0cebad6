"""Imported last by the test harness's fork server (tests/harness.py, _context), never by a test: what the
server has loaded by then (torch, dynamo, transformers) lives as long as the process and is never garbage,
so it leaves the cyclic collector (gc.freeze). A rank forked from the server then collects only what it
made itself: otherwise each full collection walks the millions of objects of those imports (~0.15-0.2 s
a pass, several a rank) and writes to their pages (copy-on-write copies of the server's memory)."""
import gc

gc.collect()
gc.freeze()
