"""Tools a policy can call (``<search>query</search>``) and tool-call parsing."""

from anchor_rl.tools.base import Tool
from anchor_rl.tools.parsing import format_result, parse_tool_call
from anchor_rl.tools.search import SearchTool

__all__ = ["SearchTool", "Tool", "format_result", "parse_tool_call"]
