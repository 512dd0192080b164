"""`specheads llama-cpp build`: build llama.cpp (llama-server, llama-bench, llama-cli) from the
llama.cpp source vendored in the pinned llama-cpp-python sdist, once, into the specheads cache,
and print the directory that `specheads bench --llama-cpp DIR` and `specheads export --format
llama.cpp --llama-cpp` take. Optional: nothing else needs it. Needs cmake, ninja and a C++
compiler; about 5 minutes on 2 cores. See bench/llama_cpp.py.
"""

from __future__ import annotations


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("llama-cpp", help="build llama.cpp once into the cache (for bench --llama-cpp)",
                              description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="llama_cpp_command", required=True)
    build = sub.add_parser("build", help="build llama-server, llama-bench and llama-cli (once)")
    build.add_argument("--jobs", type=int, default=None, help="parallel compile jobs (default: all cores)")


def run(args) -> int:
    from specheads.bench.llama_cpp import build_llama_cpp
    from specheads.data.tiny_target import default_cache_dir

    if args.jobs is not None and args.jobs < 1:
        raise ValueError(f"--jobs must be >= 1, got {args.jobs}")
    print(build_llama_cpp(default_cache_dir(), jobs=args.jobs))
    return 0
