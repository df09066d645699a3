"""Poolside Laguna's calls: GLM-4.7's markup, the function's name and then each parameter
as <arg_key>KEY</arg_key><arg_value>VALUE</arg_value>, in each <tool_call> block (mlx-lm's
laguna, which is its glm47; checkpoints converted by mlx-lm name it in their tokenizer
config). The template ends a turn with </assistant> and opens with 〈|EOS|〉: so is it
recognised, before mlx-lm's inference from the template takes it for GLM's."""

from .glm47 import FORMAT as GLM
from .tool_format import ToolFormat

FORMAT = ToolFormat(
    name="laguna",
    parser="mlx_lm.tool_parsers.laguna",
    reading=GLM.reading,
    grammar=GLM.grammar,
    detect=lambda template, vocab: "<arg_key>" in template and "</assistant>" in template and "〈|EOS|〉" in template,
)
