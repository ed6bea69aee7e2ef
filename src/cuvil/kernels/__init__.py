"""The kernel layer, shared by every target and importing none: tensor expressions (:mod:`.texpr`), the
lowering of ops to them (:mod:`.lower`), scheduling and fusion (:mod:`.schedule`), contractions (:mod:`.contraction`),
kernel-level rules (:mod:`.kernel_rules`) and the bounds proof of every access (:mod:`.bounds`)."""
