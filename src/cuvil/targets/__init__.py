"""Code generation targets: tensor expressions, op lowerings and scheduling shared by the backends."""
