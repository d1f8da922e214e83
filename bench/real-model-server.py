#!/usr/bin/env python3
"""The shared real-model server script, with llama.cpp's chunk reuse (`--cache-reuse N`) set.

usage: real-model-server.py SERVE_SCRIPT N MODEL.gguf PORT [N_CTX] [N_PARALLEL]

../shared/real-model/serve_xllamacpp.py builds the server's parameters and starts it, with no
switch for `n_cache_reuse`; this runs it with the parameter set on the way in. With it, a
request that differs from the slot's cached prompt after some point (a history bound that
dropped old turns) still gets the later chunks of at least N tokens that match from the cache,
shifted into place, instead of computing them again (docs/models.md, "Small local models").
"""
import os
import runpy
import sys

# Before libgomp loads, as the script itself does (generation on a busy 2-core machine).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import xllamacpp

script, chunk = sys.argv[1], int(sys.argv[2])
start = xllamacpp.Server


def server(params):
    params.n_cache_reuse = chunk
    return start(params)


xllamacpp.Server = server
sys.argv = [script, *sys.argv[3:]]
runpy.run_path(script, run_name="__main__")
