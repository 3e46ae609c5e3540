// results/REPORT.md: one section per experiment, each written by that experiment from the numbers
// of its run (results/<experiment>/report_section.md), assembled in a fixed order so that running
// one experiment refreshes its section and keeps the others.
#pragma once

#include <filesystem>
#include <string>
#include <vector>

namespace linrope::experiments {

struct Figure {
  std::string file;  // PNG in the experiment's directory
  std::string caption;
};

struct Section {
  std::string title;
  std::vector<std::string> paragraphs;  // markdown, generated from the measured numbers
  std::vector<Figure> figures;
};

// Markdown of a section of experiment `name`: title, a line of provenance, the figures that exist
// in `dir` (links relative to the results directory), a note for missing ones, the paragraphs.
std::string render_section(const Section& section, const std::string& name,
                           const std::filesystem::path& dir, const std::string& provenance,
                           const std::string& plot_note);

// Rewrites <out>/REPORT.md from the section files of `names` (in that order) that exist.
void assemble_report(const std::filesystem::path& out, const std::vector<std::string>& names);

// Formatting for report text: "%.3g", and a percentage "12.5%".
std::string fmt(double value, int digits = 3);
std::string percent(double fraction);

}  // namespace linrope::experiments
