"""What is trained: the run config, the model's stages, the data and its shards.

Map:
- runconfig.py   the run config schema (the "torrent file") and the run id; every section is
                 importable from here
- averaging_config.py  its ``averaging`` section: exchange, influence bounds, the edge modes' graph
- config_base.py the strict model every section is, and CrossFieldError (a rule between fields)
- model_config.py  its ``model`` section (mlp, transformer, llama)
- models.py      building the stages of a model from the run config
- llama.py       model.kind llama: Llama blocks in plain torch, state dicts named as transformers' LlamaForCausalLM
- hf_export.py   a llama run's stages as a folder transformers loads (config.json, model.safetensors), and back
- memory.py      the GPU memory a llama stage needs and the host memory every stage keeps, from the run config
                 alone (volunteer doctor), and what a built stage holds (held_bytes)
- generation.py  sampling text from an exported folder with our own modules (volunteer generate)
- tokenizer.py   the byte-level BPE tokenizer (the tokenizers library), pinned by its sha256
- dataset.py     the Dataset a run trains on, and reading and pinning a text corpus (below data.py and tokens.py)
- data.py        data sets, train/test split and shards (IID or label-skewed), rarest-first shard choice
- tokens.py      token data of llama runs: windows of (memory-mapped) token arrays by sample id; nanoGPT's layout
- text_cache.py  data.source text_files: a folder of .txt / .jsonl tokenized once into a cache beside it
- local.py       a single-process reference trainer: the yardstick for the distributed run; make_optimizer
- optim_state.py optimizer state as named tensors, so it can travel between peers and be checked
- corpus/        the text corpus shipped with the client (charlm)
"""
