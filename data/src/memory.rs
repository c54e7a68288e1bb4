//! A data set of tensors already in memory: examples along the first axis.

use ampgraph_graph::{DType, Tensor};

use crate::{DataError, Dataset, Example, Result};

/// Examples `images[i]` (any shape after the first axis, as f32) with class
/// `labels[i]` in `0..classes`.
#[derive(Clone, Debug)]
pub struct TensorDataset {
    values: Vec<f32>,
    shape: Vec<usize>,
    labels: Vec<i64>,
    classes: usize,
}

impl TensorDataset {
    /// Checks that `images` and `labels` (integers) have as many examples and every
    /// label is a class.
    pub fn new(images: &Tensor, labels: &Tensor, classes: usize) -> Result<TensorDataset> {
        let Some((&n, shape)) = images.shape().split_first() else {
            return Err(DataError::Invalid("images need an examples axis".into()));
        };
        let ints = matches!(labels.dtype(), DType::I32 | DType::I64);
        let label_values = labels.to_i64_vec().filter(|_| ints).ok_or_else(|| {
            DataError::Invalid(format!("labels of {} are not integers", labels.dtype()))
        })?;
        if labels.shape() != [n] {
            return Err(DataError::Invalid(format!(
                "{n} images but labels of shape {:?}",
                labels.shape()
            )));
        }
        if let Some(index) = (label_values.iter()).position(|&l| !(0..classes as i64).contains(&l))
        {
            return Err(DataError::Invalid(format!(
                "label {} at index {index} is not a class in 0..{classes}",
                label_values[index]
            )));
        }
        Ok(TensorDataset {
            values: images.to_f32_vec(),
            shape: shape.to_vec(),
            labels: label_values,
            classes,
        })
    }
}

impl Dataset for TensorDataset {
    fn len(&self) -> usize {
        self.labels.len()
    }

    fn shape(&self) -> &[usize] {
        &self.shape
    }

    fn classes(&self) -> usize {
        self.classes
    }

    fn get(&self, index: usize) -> Result<Example> {
        let size: usize = self.shape.iter().product();
        let label = *self.labels.get(index).ok_or(DataError::Index {
            index,
            len: self.len(),
        })?;
        Ok(Example {
            values: self.values[index * size..(index + 1) * size].to_vec(),
            label,
        })
    }

    fn describe(&self) -> String {
        format!("{} tensors of {:?} in memory", self.len(), self.shape)
    }
}
