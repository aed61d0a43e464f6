"""Print, one per line, the uv arguments that carry this machine's pip settings (uv reads no pip.conf).

pip's configuration (files and PIP_* variables, as `pip config list` shows them) may name wheel folders
(find-links), extra indexes and global constraint files; scripts/setup_env.sh hands them to `uv pip install` so
that uv resolves from the same places, with pip's rule of taking the best version across all of them.
"""
import shlex
import subprocess
import sys

FLAGS = {"find-links": "--find-links", "index-url": "--index-url", "extra-index-url": "--extra-index-url",
         "constraint": "--constraint"}


def main() -> None:
    out = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True,
                         check=True).stdout
    seen = set()
    for line in out.splitlines():
        key, _, value = line.partition("=")
        flag = FLAGS.get(key.rsplit(".", 1)[-1])
        if flag is None:
            continue
        for item in shlex.split(value)[0].split() if value else []:
            if (flag, item) not in seen:
                seen.add((flag, item))
                print(flag)
                print(item)


if __name__ == "__main__":
    main()
