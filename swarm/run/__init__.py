"""What is trained: the run config, the model's stages, the data and its shards.

Map:
- runconfig.py   the run config schema (the "torrent file") and the run id; every section is
                 importable from here
- averaging_config.py  its ``averaging`` section: exchange, influence bounds, the edge modes' graph
- config_base.py the strict model every section is, and CrossFieldError (a rule between fields)
- models.py      building the stages of a model from the run config
- data.py        data sets, train/test split and shards (IID or label-skewed), rarest-first shard choice
- local.py       a single-process reference trainer: the yardstick for the distributed run; make_optimizer
- optim_state.py optimizer state as named tensors, so it can travel between peers and be checked
- corpus/        the text corpus shipped with the client (charlm)
"""
