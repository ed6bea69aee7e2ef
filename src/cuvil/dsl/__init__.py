"""The rule DSL: the grammar (``rule.lark``), the parser (text -> rule AST, errors as ``file:line:col: message``),
validation against the op registry, and the compiler (AST -> matcher + builder)."""
