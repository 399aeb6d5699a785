"""OS-level sandbox for generated code (HumanEval): namespaces, rlimits, seccomp; the verdict comes
from a process the completion never runs in (`runner.run_check`, docs/security.md)."""
