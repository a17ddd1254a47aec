"""Triton kernels on CPU, in Triton's interpreter.

Interpreter mode is fixed per process when ``triton`` is first imported (see
``pagedserve.kernels._triton_utils.interpreter_active``), and this pytest process may already hold a
compiling Triton, imported by another test, or needed by the GPU tests of the same run. So unless the
whole run was started with ``TRITON_INTERPRET=1``, ``test_triton_kernels.py`` is not collected here and
``test_triton_interpreter.py`` runs it in a child pytest that has the variable set from the start.
"""

import pytest

pytest.importorskip("triton")

from pagedserve.kernels._triton_utils import interpreter_active

INTERPRETER_CASES = "test_triton_kernels.py"
collect_ignore = [] if interpreter_active() else [INTERPRETER_CASES]
