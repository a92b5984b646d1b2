"""One module per command; `lmforge.cli` parses the command line and calls these.

    train-tokenizer, import-tokenizer   stages.tokenizer
    prepare                             stages.prepare
    pretrain                            stages.pretrain
    sft                                 stages.sft
    dpo                                 stages.dpo
    rl                                  stages.rl
    generate, chat                      stages.generate
    eval                                stages.eval
    export, import-hf, import-gguf      stages.export
    serve                               stages.serve (imported on use: it needs the server packages)
    speedrun                            stages.speedrun
Shared by them: stages.common (the training-session preamble and tail); loading a checkpoint
to use it: lmforge.loading.load_checkpoint.
"""

from lmforge.stages.common import log
from lmforge.stages.eval import eval_stage
from lmforge.stages.export import export_stage, import_gguf_stage, import_hf_stage
from lmforge.stages.generate import chat_stage, generate_stage, generate_text
from lmforge.stages.prepare import prepare_stage
from lmforge.stages.pretrain import pretrain_stage
from lmforge.stages.sft import sft_stage
from lmforge.stages.dpo import dpo_stage
from lmforge.stages.rl import rl_stage
from lmforge.stages.speedrun import speedrun_stage
from lmforge.stages.tokenizer import import_tokenizer_stage, train_tokenizer_stage

__all__ = ["chat_stage", "dpo_stage", "eval_stage", "export_stage", "generate_stage", "generate_text", "import_gguf_stage", "import_hf_stage",
           "import_tokenizer_stage", "log", "prepare_stage", "pretrain_stage", "rl_stage", "sft_stage",
           "speedrun_stage", "train_tokenizer_stage"]
