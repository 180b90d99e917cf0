"""placeholder"""

from __future__ import annotations

from typing import Any

from tests.kubesim.controller import Controller


class FrameworkController(Controller):
    name = "frameworkcontroller"

    def __init__(self, cluster: Any) -> None:
        super().__init__()

    def reconcile(self, key: Any) -> None:
        return
