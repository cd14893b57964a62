"""Training on TPPs: a whole step (forward, loss, backward, optimizer update) as one module.

``compile_training_step(model, loss="mse"|"cross_entropy", optimizer=SGD(...)|AdamW(...))``
returns a :class:`TrainingStep` whose ``step(inputs..., labels=...)`` returns the loss and
keeps parameters and optimizer state on the device; ``models`` builds trainable MLP, BERT
layer and small CNN models; ``custom_op`` defines an operator from a TE expression with a
derived gradient (``examples`` has SwiGLU and a custom attention-score op).
"""

from .custom_op import CustomOp, custom_op
from .optim import SGD, AdamW
from .step import Model, TrainingStep, compile_training_step, training_module

__all__ = ["SGD", "AdamW", "CustomOp", "Model", "TrainingStep", "compile_training_step",
           "custom_op", "training_module"]
