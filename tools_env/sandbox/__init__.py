"""The `code` tool: runs a fenced python block in an isolated, resource-limited process.

The body of a `code` call holds a ```python fenced block (the last one is run) and optionally
a ```sh block whose text is fed to the program's stdin, as in the reference code agent. The
program runs as `main.py` in a fresh temporary working directory, deleted afterwards; stdout
and stderr are merged in order and cut to `max_output_chars` keeping head and tail.

- `policy`: the limits (`SandboxLimits`), the isolation modes and what a program may see (its
  environment, the interpreter's paths, the home directories hidden).
- `runner`: what runs one program in a sandboxed process: the command that starts the
  sandboxed interpreter, the program's files, a uid leased per run as root, the killing of
  everything a run started.
- `pool`: the persistent workers that fork each program afresh, and their pool.
- `tool`: `CodeSandbox`, the `code` tool over them, and `isolation_of`.

The boot script and the pool's worker run inside the sandbox, standard library only:
`tools_env/sandbox_boot.py` and `tools_env/sandbox_worker.py`.
"""

from tools_env.sandbox.policy import (
           HIDDEN_DIRS,
           ISOLATION_MODES,
           IsolationUnavailable,
           SandboxLimits,
           extract_program,
           weakest,
)
from tools_env.sandbox.pool import PRELOAD
from tools_env.sandbox.tool import CodeSandbox, isolation_of

__all__ = ["HIDDEN_DIRS", "ISOLATION_MODES", "PRELOAD", "CodeSandbox", "IsolationUnavailable",
           "SandboxLimits", "extract_program", "isolation_of", "weakest"]
