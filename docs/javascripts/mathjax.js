// MathJax reads this object when it loads. pymdownx.arithmatex (generic mode) wraps every
// formula in an element of class "arithmatex" with \( \) or \[ \] delimiters; only those
// elements are typeset.
window.MathJax = {
  tex: {
    inlineMath: [["\\(", "\\)"]],
    displayMath: [["\\[", "\\]"]],
    processEscapes: true,
    processEnvironments: true,
  },
  options: {
    ignoreHtmlClass: ".*",
    processHtmlClass: "arithmatex",
  },
};

// Material's instant navigation swaps page content without a reload: typeset again each time.
if (typeof document$ !== "undefined") {
  document$.subscribe(() => {
    if (window.MathJax && window.MathJax.typesetPromise) {
      window.MathJax.typesetClear && window.MathJax.typesetClear();
      window.MathJax.typesetPromise();
    }
  });
}
