"""SSD's detection layers: PriorBox, DetectionOutput, DetectionEvaluate (layers.py) and
MultiBoxLoss with its matching and mining (multibox_loss.py, multibox_match.py). MultiBoxLoss
is a loss, but it lives here: it decodes and matches boxes with the same engines as
DetectionOutput, boxes.py on the host and gpu.py (cuda/detection.cu). RefineDet's two-step
forms extend DetectionOutput and MultiBoxLoss. The YOLO ports' heads: Region (region.py) and
MobileNet-YOLO's YoloDetectionOutput and Yolov3DetectionOutput (yolo.py)."""
