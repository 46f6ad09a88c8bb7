"""Training: one engine (:mod:`.engine`) that pre-training (:mod:`.pretrain`) and SFT (:mod:`.sft`) plug into.

Components, each a module: :mod:`.config` (options and the config-file reader), :mod:`.schedule` (LR, K, feedback
switch-on), :mod:`.optimizer`, :mod:`.checkpoint` (atomic writes, weights-only loads), :mod:`.metrics` (log and
guard), :mod:`.distributed` (DDP / FSDP2), :mod:`.device` (precision, allocator), :mod:`.presets`, :mod:`.chat`
(SFT data). Nothing is imported here, so ``import fullband`` stays light.
"""
