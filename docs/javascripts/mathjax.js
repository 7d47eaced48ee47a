// MathJax settings for pymdownx.arithmatex (generic mode): the formulas on the Algorithms page.
// The build fetches nothing; a reader's browser loads MathJax when it shows the page (offline,
// the formulas stay readable as TeX).
window.MathJax = {
  tex: { inlineMath: [["\\(", "\\)"]], displayMath: [["\\[", "\\]"]], processEscapes: true },
  options: { ignoreHtmlClass: ".*|", processHtmlClass: "arithmatex" },
};
