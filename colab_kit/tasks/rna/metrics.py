"""How well a classifier sorts RNA families: accuracy, macro-F1, Matthews correlation, a per-class
report and the confusion matrix, on each test set.
"""

from __future__ import annotations

__all__ = ["classification_metrics", "accuracy", "evaluate"]


def classification_metrics(y_true: list[str], y_pred: list[str], labels: list[str]) -> dict:
    """Accuracy, macro-F1, Matthews correlation, a per-class report and the confusion matrix."""
    from sklearn.metrics import accuracy_score, classification_report, confusion_matrix, f1_score, matthews_corrcoef

    return {
        "n": len(y_true),
        "accuracy": float(accuracy_score(y_true, y_pred)),
        "macro_f1": float(f1_score(y_true, y_pred, labels=labels, average="macro", zero_division=0)),
        "mcc": float(matthews_corrcoef(y_true, y_pred)),
        "per_class": classification_report(y_true, y_pred, labels=labels, output_dict=True, zero_division=0),
        "confusion": confusion_matrix(y_true, y_pred, labels=labels).tolist(),
        "labels": list(labels),
    }


def accuracy(prediction) -> dict:
    """The Trainer's `compute_metrics` for evaluation during training: accuracy of the arg-max class."""
    import numpy as np

    return {"accuracy": float((np.argmax(prediction.predictions, -1) == prediction.label_ids).mean())}


def evaluate(trainer, test_sets: dict, labels: list[str], *, report: str | None = None) -> dict:
    """`classification_metrics` for each named test set (`trainer.predict` on each), printed one line
    per set, with scikit-learn's per-class report for the set named `report`; returns them by name."""
    from sklearn.metrics import classification_report

    metrics = {}
    for name, dataset in test_sets.items():
        output = trainer.predict(dataset)
        truth = [labels[int(i)] for i in output.label_ids]
        predicted = [labels[int(i)] for i in output.predictions.argmax(-1)]
        metrics[name] = m = classification_metrics(truth, predicted, labels)
        print(f"{name}: accuracy {m['accuracy']:.3f}, macro-F1 {m['macro_f1']:.3f}, MCC {m['mcc']:.3f} "
              f"({m['n']} sequences)")
        if name == report:
            print(classification_report(truth, predicted, labels=labels, zero_division=0))
    return metrics
