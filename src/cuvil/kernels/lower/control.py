"""No lowerings: If, Loop and Scan never reach the kernel layer. The frontend expands them on import into the
ops of their subgraphs (:mod:`cuvil.frontend.subgraphs`), which lower through their own families; the
rows of :data:`cuvil.kernels.support.EXPANDED_ON_IMPORT` say what each expansion needs."""
