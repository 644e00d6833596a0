"""Training and calibration data: the built-in text (corpus), source kinds as registered plug-ins (source, sources),
mix recipes and the streaming packed loader (mix_recipe, mix), documents, chat templates, teacher-written chats
(selfgen), decontamination, and prepared token shards (shards, prepare)."""
