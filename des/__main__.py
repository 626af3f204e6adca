"""``python -m des``: the commands this package installs, and what each is for.

    $ python -m des
      des-train    (python -m des.train)      train a model: one process, DES, the PS or the cache ...
    $ python -m des train --mode des ...       (the same as des-train --mode des ...)
"""
from __future__ import annotations

import sys

COMMANDS = [
    ("des-train", "des.train", "train a model: one process, DES, the PS or the cache (--mode); mpirun for N"),
    ("des-predict", "des.predict", "score a file with a checkpoint (any mode, any number of processes)"),
    ("des-export", "des.export", "write one SavedModel from a checkpoint"),
    ("des-compare", "des.compare", "the same model in several modes side by side: AUC, samples/s, bytes"),
    ("des-netbed", "des.netbed", "the emulated cluster: network namespaces with shaped links (root)"),
    ("des-launch", "des.launch", "run des.train under mpirun, restarting from its last checkpoint when a process dies"),
]


def main(argv: list[str] | None = None) -> int:
    """Print the commands; ``python -m des <command> ...`` runs one of them."""
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] not in ("-h", "--help"):
        names = {c: m for c, m, _ in COMMANDS} | {m.split(".")[1]: m for _, m, _ in COMMANDS}
        if argv[0] not in names:
            print(f"python -m des: unknown command {argv[0]!r}; one of {', '.join(c for c, _, _ in COMMANDS)}",
                  file=sys.stderr)
            return 2
        import importlib
        return importlib.import_module(names[argv[0]]).main(argv[1:]) or 0
    print("DES - Distributed Equivalent Substitution for tf.keras CTR models. Commands (each with --help):\n")
    for command, module, what in COMMANDS:
        print(f"  {command:<12} {'(python -m ' + module + ')':<26} {what}")
    print("\nIn Python: model, report = des.transform(keras_model)   (help(des.transform))")
    return 0


if __name__ == "__main__":
    sys.exit(main())
