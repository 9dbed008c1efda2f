{{/* Names: every object is "<release>-<component>", cut to the 63-character DNS label limit. */}}
{{- define "sapd.name" -}}
{{- printf "%s-%s" .root.Release.Name .component | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "sapd.labels" -}}
app.kubernetes.io/name: sapd
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
app.kubernetes.io/component: {{ .component }}
helm.sh/chart: {{ printf "%s-%s" .root.Chart.Name .root.Chart.Version }}
{{- end -}}

{{- define "sapd.selectorLabels" -}}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{/* The job block's image over the top-level one. */}}
{{- define "sapd.image" -}}
{{- $img := mergeOverwrite (deepCopy .root.Values.image) (.job.image | default dict) -}}
image: {{ printf "%s:%s" $img.repository $img.tag | quote }}
imagePullPolicy: {{ $img.pullPolicy }}
{{- end -}}

{{/* The resolved overlay of one job: the shared `config`, the job's own `config` over it, and the
     values that the chart owns (run_root, workers). */}}
{{- define "sapd.jobConfig" -}}
{{- $cfg := mergeOverwrite (deepCopy .root.Values.config) (deepCopy (.job.config | default dict)) -}}
{{- $_ := set $cfg "run_root" .root.Values.runRoot -}}
{{- $_ := set $cfg "workers" (int .root.Values.teacherScores.parallelism) -}}
{{- include "sapd.yaml" $cfg -}}
{{- end -}}

{{/* toYaml, except that a float Go writes as "1e-06" becomes "1.0e-06": YAML 1.1 (PyYAML, which
     sapd.config reads with) needs the dot, and would read "1e-06" as a string. */}}
{{- define "sapd.yaml" -}}
{{- $y := toYaml . -}}
{{- $y = regexReplaceAll "(?m)^(\\s*(?:- |[^\\s:#'\"][^:#'\"]*: +)-?[0-9]+)([eE][-+]?[0-9]+)$" $y "${1}.0${2}" -}}
{{- $y -}}
{{- end -}}

{{/* Environment every job gets: S3 endpoint and credentials, the Pushgateway, caches on /scratch. */}}
{{- define "sapd.env" -}}
- name: SAPD_S3_ENDPOINT_URL
  value: {{ .root.Values.s3.endpoint | quote }}
- name: AWS_DEFAULT_REGION
  value: {{ .root.Values.s3.region | quote }}
- name: AWS_ACCESS_KEY_ID
  valueFrom:
    secretKeyRef:
      name: {{ .root.Values.s3.secretName }}
      key: {{ .root.Values.s3.accessKeyIdKey }}
- name: AWS_SECRET_ACCESS_KEY
  valueFrom:
    secretKeyRef:
      name: {{ .root.Values.s3.secretName }}
      key: {{ .root.Values.s3.secretAccessKeyKey }}
- name: SAPD_PUSHGATEWAY_URL
  value: {{ .root.Values.pushgateway.url | quote }}
- name: SAPD_JOB
  value: {{ .component }}
- name: SAPD_RELEASE
  value: {{ .root.Release.Name | quote }}
- name: HOME
  value: /scratch/home
- name: HF_HOME
  value: /scratch/hf
- name: PYTHONUNBUFFERED
  value: "1"
{{- end -}}

{{/* Batch fields every Job spec carries. */}}
{{- define "sapd.batchFields" -}}
backoffLimit: {{ int .job.backoffLimit }}
activeDeadlineSeconds: {{ int .job.activeDeadlineSeconds }}
ttlSecondsAfterFinished: {{ int .job.ttlSecondsAfterFinished }}
{{- end -}}

{{/* Pod-spec fields shared by every job: security, scheduling, the config and scratch volumes.
     Call with (dict "root" $ "component" "train" "job" .Values.train "shm" "64Gi"); "extraVolumes" and
     "extraMounts" (lists) add the pipeline driver's own volume. */}}
{{- define "sapd.podCommon" -}}
restartPolicy: Never
securityContext:
  {{- toYaml .root.Values.securityContext.pod | nindent 2 }}
{{- with .root.Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .job.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .job.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
volumes:
  - name: config
    configMap:
      name: {{ include "sapd.name" (dict "root" .root "component" "config") }}
      items:
        - key: {{ .component }}.yaml
          path: config.yaml
  - name: scratch
    emptyDir:
      sizeLimit: {{ .root.Values.scratchSize }}
  - name: tmp
    emptyDir: {}
  {{- with .shm }}
  - name: dshm
    emptyDir:
      medium: Memory
      sizeLimit: {{ . }}
  {{- end }}
  {{- with .extraVolumes }}
  {{- toYaml . | nindent 2 }}
  {{- end }}
{{- end -}}

{{/* Container fields shared by every job. */}}
{{- define "sapd.containerCommon" -}}
{{ include "sapd.image" . }}
securityContext:
  {{- toYaml .root.Values.securityContext.container | nindent 2 }}
resources:
  {{- toYaml .job.resources | nindent 2 }}
volumeMounts:
  - name: config
    mountPath: /etc/sapd
    readOnly: true
  - name: scratch
    mountPath: /scratch
  - name: tmp
    mountPath: /tmp
  {{- if .shm }}
  - name: dshm
    mountPath: /dev/shm
  {{- end }}
  {{- with .extraMounts }}
  {{- toYaml . | nindent 2 }}
  {{- end }}
{{- end -}}
